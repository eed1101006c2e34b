"""Prompts of the RLHF recipe: the opening words of movie reviews, one JSONL row each.

    python paper_repro/_sentiment_corpus.py --fetch                         # once: the corpus, into ~/.cache/rljax
    python experiments/rlhf_sentiment_prompts.py runs/rlhf_sentiment/prompts.jsonl

Each row is ``{"prompt": the first --prefix-words words of a snippet}`` of the 10,605 movie-review
snippets of the VADER paper (``paper_repro/_sentiment_corpus.py``), in a fixed shuffled order (so a
run's ``data.train_size`` takes a mix of positive and negative reviews, not the file's first ones).
Snippets shorter than ``prefix_words + 2`` words and repeated prefixes are skipped. The training
and held-out prompts are split from this one file by rljax's own rule (``data.eval_fraction``, a
hash of the seed and the prompt), so the preference pairs, the reward model and the policies all
hold out the same prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "paper_repro"))  # the corpus module
import _sentiment_corpus as corpus  # noqa: E402


def review_prefixes(snippets: Sequence[corpus.Snippet], *, prefix_words: int, seed: int = 0) -> list[str]:
    """The distinct ``prefix_words``-word openings of ``snippets``, shuffled by ``seed``."""
    seen, out = set(), []
    for s in snippets:
        split = corpus.split_snippet(s.text, prefix_words=prefix_words, response_words=1)
        if split is not None and split[0] not in seen:
            seen.add(split[0])
            out.append(split[0])
    random.Random(seed).shuffle(out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("output", help="JSONL file to write")
    parser.add_argument("--prefix-words", type=int, default=4, help="words of each review kept (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed (default: %(default)s)")
    args = parser.parse_args(argv)
    prefixes = review_prefixes(corpus.read_snippets(), prefix_words=args.prefix_words, seed=args.seed)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for p in prefixes:
            f.write(json.dumps({"prompt": p}) + "\n")
    print(f"wrote {len(prefixes)} prompts to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
