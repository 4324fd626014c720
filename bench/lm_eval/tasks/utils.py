"""Data loaders for the local lm-eval tasks: the JSONL files beside this file, so the tasks run from any working
directory and never touch the network (datasets' packaged `json` builder reads local files only)."""

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _load(name: str) -> datasets.DatasetDict:
    return datasets.load_dataset("json", data_files={"test": str(HERE / name)})


def load_mc(**_kw) -> datasets.DatasetDict:
    return _load("pycode_mc.jsonl")


def load_ppl(**_kw) -> datasets.DatasetDict:
    return _load("pycode_ppl.jsonl")
