"""Budgets a structured-output constraint must fit before anything compiles it (engine/grammar.py): its size, a JSON
schema's depth and node count, the number of choices. Checked where the constraint is made (StructuredOutputs), so
an oversized one is a 400 naming the limit at the front door: a schema nested ~900 deep broke the pickling of the
request on its way to the group (a 500), and a 100k-string choice or a 10k-pattern schema held a compile thread for
20-60 s of CPU before it failed, on every retry. Iterative walks: a deep value must not exhaust Python's recursion.
"""

from __future__ import annotations

import json
from typing import Any

MAX_BYTES = 256 * 1024  # the constraint as JSON text (a schema, a regex, a grammar, the choices together)
MAX_DEPTH = 64  # nesting of a JSON schema's objects and arrays
MAX_NODES = 10_000  # values in a JSON schema (objects, arrays, scalars)
MAX_CHOICES = 4_096
COMPILE_S = 10.0  # the most a compile may take on the serving path (runtime/group.py); also capped by queue_s


class BudgetError(ValueError):
    """A constraint past a budget: the message names the limit."""


def check_budget(json_schema: Any = None, text: str | None = None, choice: list | None = None) -> None:
    """A constraint's parts within the budgets above, else BudgetError naming the limit that was passed."""
    if choice is not None and len(choice) > MAX_CHOICES:
        raise BudgetError(f"has {len(choice)} choices, past the limit of {MAX_CHOICES}")
    size = len(text.encode("utf-8", "surrogatepass")) if text is not None else 0
    if choice is not None:
        size = sum(len(c.encode("utf-8", "surrogatepass")) + 4 for c in choice if isinstance(c, str))
    if json_schema is not None:
        if isinstance(json_schema, str):
            size = len(json_schema.encode("utf-8", "surrogatepass"))
            if size <= MAX_BYTES:
                try:
                    json_schema = json.loads(json_schema)
                except RecursionError:
                    raise BudgetError(f"is a JSON schema nested past the limit of {MAX_DEPTH} levels") from None
                except ValueError:
                    return  # not JSON: the compile names what is wrong with it
        depth, nodes = _shape(json_schema)
        if depth > MAX_DEPTH:
            raise BudgetError(f"is a JSON schema nested past the limit of {MAX_DEPTH} levels")
        if nodes > MAX_NODES:
            raise BudgetError(f"is a JSON schema of more values than {MAX_NODES}, past the limit")
    if size > MAX_BYTES:
        raise BudgetError(f"is {size} bytes, past the limit of {MAX_BYTES}")


def _shape(value: Any) -> tuple[int, int]:
    """(nesting depth, number of values) of a JSON value, walked without recursion; stops counting past the
    budgets (a larger value fails either way)."""
    depth, nodes, stack = 0, 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        nodes += 1
        depth = max(depth, d)
        if depth > MAX_DEPTH or nodes > MAX_NODES:
            break
        if isinstance(v, dict):
            stack += [(x, d + 1) for x in v.values()]
            nodes += len(v)  # the keys
        elif isinstance(v, (list, tuple)):
            stack += [(x, d + 1) for x in v]
    return depth, nodes
