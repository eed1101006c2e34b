"""Procedural tasks with verifiable answers and held-out splits fixed by one seed.

    train = make_task("addition", split="train", size=1000, seed=0)
    evals = make_task("addition", split="eval", size=200, seed=0)

Each example is a dict with `prompt` (the user text), `answer` (a string), `task`, `key` (what
identifies the question, used for the split) and, for reasoning-gym tasks, `question` and
`metadata` (which `rljax.rewards` verifiers such as `countdown` and `reasoning_gym` read).

How splits stay disjoint: every question is assigned to one split by a hash of `(seed, task,
key)`: a fraction `eval_fraction` of the question space belongs to eval and the rest to train,
whatever the requested sizes. Train and eval then draw from their own part with their own
derived seeds, without repeats. So the eval set of seed s never leaks into its train set, even
for tiny spaces like 2-digit addition (8,100 questions), and growing `size` only extends a list
(the first k examples of a larger request equal a request of size k).

Note reasoning-gym's generators seed entry i with `Random(seed + i)`: two datasets whose seeds
differ by d share all but d entries (shifted), so "seed and seed+1" would be near-identical
splits. The hash partition above is what makes the splits disjoint; the derived seeds only decorrelate
the streams.

Tasks: `addition` (own generator: "What is 12+35?" -> "47") and any reasoning-gym dataset by name
(`basic_arithmetic`, `chain_sum`, `countdown`, `gsm_symbolic`, ...), options passed to its config.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import numpy as np

TaskGenerator = Callable[..., list[dict[str, Any]]]

# Default share of the question space held out for eval. reasoning-gym tasks use 0.5: their spaces
# are huge, so the share does not matter, and drawing from half the space costs 2x generation for
# either split (countdown and gsm_symbolic take ~10-16 ms per entry).
DEFAULT_EVAL_FRACTION = {"addition": 0.1}
DEFAULT_RG_EVAL_FRACTION = 0.5

_SPLITS = ("train", "eval")


def _derived_seed(*parts: Any) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


def _unit_hash(seed: int, task: str, key: str) -> float:
    """A uniform number in [0, 1) fixed by (seed, task, key): the question's place in the split."""
    digest = hashlib.blake2b(f"{seed}\x00{task}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def question_split(key: str, *, task: str, seed: int, eval_fraction: float) -> str:
    """Which split ("train" or "eval") the question identified by `key` belongs to."""
    return "eval" if _unit_hash(seed, task, key) < eval_fraction else "train"


def _check_common(name: str, split: str, size: int, eval_fraction: float) -> None:
    if split not in _SPLITS:
        raise ValueError(f"task {name!r}: split must be one of {_SPLITS}, got {split!r}")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
        raise ValueError(f"task {name!r}: size must be a non-negative integer, got {size!r}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"task {name!r}: eval_fraction must be in (0, 1), got {eval_fraction!r}")


# ---------------------------------------------------------------------------------------------
# addition


def _addition(
    *,
    split: str,
    size: int,
    seed: int,
    eval_fraction: float,
    digits: int = 2,
    instruction: str | None = None,
) -> list[dict[str, Any]]:
    """Two-operand additions of `digits`-digit numbers: "What is 12+35?" -> "47"."""
    if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 9:
        raise ValueError(f"task 'addition': digits must be an integer in [1, 9], got {digits!r}")
    low, high = 10 ** (digits - 1) if digits > 1 else 0, 10**digits  # operands in [low, high)
    span = high - low
    space = span * span
    rng = np.random.default_rng(_derived_seed(seed, "addition", split, digits))
    in_split = lambda a, b: question_split(  # noqa: E731
        f"{a}+{b}", task="addition", seed=seed, eval_fraction=eval_fraction) == split

    pairs: list[tuple[int, int]] = []
    if space <= 250_000:
        # Small space: shuffle all of it once and keep the questions of this split, in order.
        for flat in rng.permutation(space):
            a, b = low + int(flat) // span, low + int(flat) % span
            if in_split(a, b):
                pairs.append((a, b))
                if len(pairs) == size:
                    break
        if len(pairs) < size:
            raise ValueError(
                f"task 'addition' (digits={digits}): the {split} split has only {len(pairs)} distinct "
                f"questions (eval_fraction={eval_fraction}), fewer than size={size}"
            )
    else:
        seen: set[tuple[int, int]] = set()
        while len(pairs) < size:
            a, b = (int(x) for x in rng.integers(low, high, size=2))
            if (a, b) not in seen and in_split(a, b):
                seen.add((a, b))
                pairs.append((a, b))
    suffix = f" {instruction}" if instruction else ""
    return [
        {"prompt": f"What is {a}+{b}?{suffix}", "answer": str(a + b), "task": "addition",
         "key": f"{a}+{b}", "operands": [a, b]}
        for a, b in pairs
    ]


# ---------------------------------------------------------------------------------------------
# reasoning-gym


def _rg_key(name: str, entry: dict[str, Any]) -> str:
    metadata = entry.get("metadata") or {}
    if name == "countdown" and "numbers" in metadata:
        # The same numbers and target under another prompt template is the same problem.
        return f"{sorted(metadata['numbers'])}->{metadata['target']}"
    if "expression" in metadata:
        return str(metadata["expression"])
    return str(entry["question"])


def _reasoning_gym(
    name: str,
    *,
    split: str,
    size: int,
    seed: int,
    eval_fraction: float,
    instruction: str | None = None,
    max_draws: int | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    import reasoning_gym

    stream_seed = _derived_seed(seed, name, split)
    limit = max_draws if max_draws is not None else 20 * size + 1000
    try:
        # `size` bounds the indices; some generators precompute per index (gsm_symbolic picks a
        # template for each), so it is the draw limit, not a huge number. Prefixes stay stable.
        dataset = reasoning_gym.create_dataset(name, seed=stream_seed, size=limit, **options)
    except TypeError as exc:
        raise ValueError(f"task {name!r}: bad option for reasoning-gym's config: {exc}") from exc
    suffix = f" {instruction}" if instruction else ""
    examples: list[dict[str, Any]] = []
    seen: set[str] = set()
    index = 0
    while len(examples) < size:
        if index >= limit:
            raise ValueError(
                f"task {name!r}: found only {len(examples)} distinct {split} questions in {limit} "
                f"draws (size={size}); the configured question space may be too small"
            )
        entry = dataset[index]
        index += 1
        key = _rg_key(name, entry)
        if key in seen or question_split(key, task=name, seed=seed, eval_fraction=eval_fraction) != split:
            continue
        seen.add(key)
        examples.append({
            "prompt": entry["question"] + suffix,
            "answer": str(entry["answer"]),
            "task": name,
            "key": key,
            "question": entry["question"],
            "metadata": entry["metadata"],
        })
    return examples


# ---------------------------------------------------------------------------------------------
# registry

_TASKS: dict[str, TaskGenerator] = {"addition": _addition}


def register_task(name: str, generator: TaskGenerator, *, overwrite: bool = False) -> None:
    """Add a task: `generator(*, split, size, seed, eval_fraction, **options) -> list[dict]`.

    The generator must keep train and eval disjoint for the given `eval_fraction` (see
    `question_split`) and be deterministic in its arguments.
    """
    if name in _TASKS and not overwrite:
        raise ValueError(f"task {name!r} is already registered; pass overwrite=True to replace it")
    _TASKS[name] = generator


def available_tasks() -> tuple[str, ...]:
    """Own tasks plus every reasoning-gym dataset name."""
    import reasoning_gym.factory

    return tuple(sorted(set(_TASKS) | set(reasoning_gym.factory.DATASETS)))


def make_task(
    name: str,
    *,
    split: str = "train",
    size: int,
    seed: int,
    eval_fraction: float | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """Generate `size` distinct examples of task `name` for `split` ("train" or "eval").

    Deterministic in all arguments; train and eval of one `seed` (and `eval_fraction`) never share
    a question. `options` go to the generator: `addition` takes `digits` (default 2); reasoning-gym
    tasks take their config fields (e.g. `min_numbers`, `max_target` for countdown). All take
    `instruction`, text appended to each prompt (e.g. "Put the final answer in <answer></answer>
    tags."); `max_draws` bounds how many reasoning-gym entries are drawn before giving up.
    """
    if eval_fraction is None:
        eval_fraction = DEFAULT_EVAL_FRACTION.get(name, DEFAULT_RG_EVAL_FRACTION)
    _check_common(name, split, size, eval_fraction)
    if name in _TASKS:
        return _TASKS[name](split=split, size=int(size), seed=seed, eval_fraction=eval_fraction,
                            **options)
    import reasoning_gym.factory

    if name not in reasoning_gym.factory.DATASETS:
        raise KeyError(f"unknown task {name!r}; own tasks: {sorted(_TASKS)}; or any reasoning-gym "
                       f"dataset, e.g. basic_arithmetic, chain_sum, countdown, gsm_symbolic")
    return _reasoning_gym(name, split=split, size=int(size), seed=seed, eval_fraction=eval_fraction,
                          **options)
