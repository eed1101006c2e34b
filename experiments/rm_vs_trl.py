"""rljax's reward model beside TRL's ``RewardTrainer``: same pairs, same steps, LoRA and full fine-tuning.

    rljax convert smollm2-135m-instruct /tmp/smollm2-hf     # TRL's model (the dequantised GGUF), made if absent
    PYTHONPATH=. nice -n 10 python experiments/rm_vs_trl.py [--steps 10] [--batch 4] [--train 48] [--eval 32] [--no-trl]

Two preferences on prompts of the two-digit addition task (with a short system prompt, so that
SmolLM2's chat template adds no default one), built deterministically:

- ``format``: the same right answer with and without ``<answer>`` tags, tagged preferred
  ("The answer is <answer>57</answer>." over "The answer is 57."): learnable from the text alone.
- ``arithmetic``: the right sum over a wrong one, both tagged
  (``rljax.data.preferences.pairs_from_task``, the pairs of reward_model_smollm2_arith.yaml).

Each preference is trained by each framework with LoRA (rank 16, alpha 32, the seven projections,
the head fully trained, lr 1e-3) and with full fine-tuning (lr 1e-5): ``--batch`` pairs, ``--steps``
steps, AdamW (no weight decay), 2 warm-up steps then constant, grad clip 1.0, the centering term 0.01,
float32, one seed. TRL's model is ``AutoModelForSequenceClassification`` (a fresh normal(0.02) score
head, as rljax's ``model.value_head_init: normal``). Held-out accuracy: chosen scored above rejected
on the ``--eval`` pairs (questions never in the train pairs). Seconds per step: the median of the
training steps' wall times (rljax's ``time/step_s``; a callback around TRL's steps), so rljax's first
step, which compiles, does not count; "train s" is the whole training loop, compile included.
Each run is a child process of its own (one side, one preference, one setting): rljax under the
malloc settings ``rljax train`` applies (``rljax.host_memory``), TRL as torch runs by default, with as
many threads as JAX's CPU backend uses and ``OMP_WAIT_POLICY=PASSIVE``, as in
experiments/perf/grpo_step.py. Writes experiments/results/rm_vs_trl.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts: see experiments/perf/sampler.py

import argparse
import json
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEM = "Put the answer in <answer></answer> tags."  # short: sequences of ~45 tokens keep a step cheap
SETTINGS = {"lora": {"lora_rank": 16, "lora_alpha": 32.0, "learning_rate": 1e-3},
            "full": {"lora_rank": None, "lora_alpha": 16.0, "learning_rate": 1e-5}}
LORA_TARGETS_HF = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_pairs(preference: str, split: str, size: int) -> list[dict[str, str]]:
    """``size`` pairs ``{prompt, chosen, rejected}`` of the addition task's ``split``."""
    from rljax.data.preferences import pairs_from_task
    from rljax.data.tasks import make_task

    examples = make_task("addition", split=split, size=size, seed=0, digits=2)
    if preference == "format":
        return [{"prompt": ex["prompt"], "chosen": f"The answer is <answer>{ex['answer']}</answer>.",
                 "rejected": f"The answer is {ex['answer']}."} for ex in examples]
    return [{k: p[k] for k in ("prompt", "chosen", "rejected")}
            for p in pairs_from_task(examples, seed=1 if split == "eval" else 0)]


def _write_jsonl(path: str, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def run_rljax(train_path: str, eval_path: str, run_dir: str, *, setting: str, steps: int, batch: int,
              eval_size: int) -> dict[str, float]:
    from rljax.config import from_yaml
    from rljax.run_config import RunConfig
    from rljax.training import OfflineTrainer

    s = SETTINGS[setting]
    lora = "" if s["lora_rank"] is None else f", lora_rank: {s['lora_rank']}, lora_alpha: {s['lora_alpha']}"
    cfg = from_yaml(RunConfig, f"""
model: {{name: smollm2-135m-instruct{lora}}}
data: {{task: "", path: {train_path}, eval_path: {eval_path}, eval_size: {eval_size}, max_prompt_length: 128,
        system_prompt: {json.dumps(SYSTEM)}}}
algorithm: {{name: reward_model, batch_size: {batch}, micro_batch_size: {batch}, max_completion_length: 32,
             centering_coef: 0.01}}
optim: {{learning_rate: {s['learning_rate']}, warmup_steps: 2}}
train: {{steps: {steps}, seed: 0, run_dir: {run_dir}, progress: false, save_model: false}}
""")
    start = time.perf_counter()
    summary = OfflineTrainer(cfg).fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        step_s = [r["time/step_s"] for r in map(json.loads, f) if "time/step_s" in r]
    return {"accuracy": summary["after"]["eval/rewards/accuracy"],
            "accuracy_before": summary["before"]["eval/rewards/accuracy"],
            "step_s": statistics.median(step_s[1:] or step_s),
            "train_s": summary.get("train_seconds", time.perf_counter() - start)}


def run_trl(model_dir: str, train_rows, eval_rows, out_dir: str, *, setting: str, steps: int,
            batch: int) -> dict[str, float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import RewardConfig, RewardTrainer

    s = SETTINGS[setting]

    def conversational(rows):
        return Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": r["prompt"]}],
                                   "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                   "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self._t0 = [], None

        def on_step_begin(self, args, state, control, **kw):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._t0)

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    peft_config = None
    if s["lora_rank"] is not None:
        from peft import LoraConfig

        peft_config = LoraConfig(r=s["lora_rank"], lora_alpha=s["lora_alpha"], lora_dropout=0.0,
                                 target_modules=LORA_TARGETS_HF, modules_to_save=["score"], task_type="SEQ_CLS")
    args = RewardConfig(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=batch,
                        per_device_eval_batch_size=batch, learning_rate=s["learning_rate"], warmup_steps=2,
                        lr_scheduler_type="constant_with_warmup", weight_decay=0.0, max_grad_norm=1.0,
                        center_rewards_coefficient=0.01, max_length=256, report_to=[], save_strategy="no",
                        eval_strategy="no", logging_steps=max(steps, 1), use_cpu=True, bf16=False, seed=0,
                        gradient_checkpointing=False, dataloader_num_workers=0)
    timer = StepTimes()
    trainer = RewardTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=conversational(train_rows),
                            eval_dataset=conversational(eval_rows), peft_config=peft_config, callbacks=[timer])
    before = trainer.evaluate()["eval_accuracy"]
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    return {"accuracy": trainer.evaluate()["eval_accuracy"], "accuracy_before": before,
            "step_s": statistics.median(timer.times), "train_s": train_s}


def _ensure_hf_dir(path: str) -> str:
    if not os.path.isfile(os.path.join(path, "config.json")):
        from rljax.tools.cli import main as rljax_main

        rljax_main(["convert", "smollm2-135m-instruct", path])
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="pairs per step")
    parser.add_argument("--train", type=int, default=48, help="train pairs per preference")
    parser.add_argument("--eval", type=int, default=32, help="held-out pairs per preference")
    parser.add_argument("--hf-dir", default=os.path.join(tempfile.gettempdir(), "smollm2-135m-instruct-hf"))
    parser.add_argument("--preferences", default="format,arithmetic")
    parser.add_argument("--settings", default="lora,full")
    parser.add_argument("--no-trl", action="store_true", help="the rljax side only")
    parser.add_argument("--trl-rljax-malloc", action="store_true",
                        help="run TRL's side under rljax's malloc settings too (default: torch as it runs by default)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "rm_vs_trl.md"))
    parser.add_argument("--side", choices=["rljax", "trl"], help=argparse.SUPPRESS)  # a child: one run
    parser.add_argument("--result", help=argparse.SUPPRESS)  # where a child writes its numbers (JSON)
    args = parser.parse_args(argv)
    if args.side:
        return _child(args)
    trl_error = None
    if not args.no_trl:
        try:
            import trl  # noqa: F401

            _ensure_hf_dir(args.hf_dir)
        except Exception as e:  # TRL missing or not importable against these versions: keep rljax's side
            trl_error = f"{type(e).__name__}: {e}"
            print("TRL side skipped:", trl_error, file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preference in args.preferences.split(","):
            for setting in args.settings.split(","):
                ours = _run_child(args, "rljax", preference, setting, tmp)
                print("rljax", preference, setting, ours, flush=True)
                theirs = None
                if not args.no_trl and trl_error is None:
                    try:
                        theirs = _run_child(args, "trl", preference, setting, tmp)
                        print("trl", preference, setting, theirs, flush=True)
                    except Exception as e:
                        trl_error = f"{type(e).__name__}: {e}"
                        print("TRL run failed:", trl_error, file=sys.stderr)
                t = theirs or {}
                ratio = f"{t['step_s'] / ours['step_s']:.2f}x" if theirs else "-"
                rows.append([preference, setting, f"{ours['accuracy_before']:.3f} -> {ours['accuracy']:.3f}",
                             f"{t['accuracy_before']:.3f} -> {t['accuracy']:.3f}" if theirs else "-",
                             f"{ours['step_s']:.2f}", f"{t['step_s']:.2f}" if theirs else "-", ratio,
                             f"{ours['train_s']:.0f}", f"{t['train_s']:.0f}" if theirs else "-"])
                _report(args, rows, trl_error)
    _report(args, rows, trl_error)


def _run_child(args, side: str, preference: str, setting: str, tmp: str) -> dict[str, float]:
    """One side's run of one preference and setting in a fresh process (its own threads, memory and
    malloc settings); its output goes to this process's, its numbers come back through a JSON file."""
    import subprocess

    result = os.path.join(tmp, f"{side}-{preference}-{setting}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--result", result, "--preferences", preference,
           "--settings", setting, "--steps", str(args.steps), "--batch", str(args.batch), "--train", str(args.train),
           "--eval", str(args.eval), "--hf-dir", args.hf_dir] + (["--trl-rljax-malloc"] if args.trl_rljax_malloc else [])
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise RuntimeError(f"the {side} run of {preference}/{setting} exited with {done.returncode}")
    with open(result) as f:
        return json.load(f)


def _child(args) -> None:
    """One run (``--side``, one preference, one setting) in this process.

    rljax runs under the malloc settings `rljax train` applies first thing (rljax/host_memory.py):
    without them its full fine-tuning update measured 1.9-2.4 s against 1.7 s with them (XLA:CPU
    page-faulted its temporaries in on every call); before 2026-11-24 this script ran both sides in
    one process without them. TRL runs as torch does by default; in one process under rljax's
    settings it measured 2-28 % slower (``--trl-rljax-malloc`` runs it so)."""
    if args.side == "rljax" or args.trl_rljax_malloc:
        from rljax.host_memory import keep_host_memory

        keep_host_memory()  # before JAX or torch start their threads
    if args.side == "trl":
        import torch

        torch.set_num_threads(os.cpu_count() or 1)  # the threads XLA's CPU backend uses
    preference, setting = args.preferences, args.settings
    train_rows, eval_rows = make_pairs(preference, "train", args.train), make_pairs(preference, "eval", args.eval)
    with tempfile.TemporaryDirectory() as tmp:
        if args.side == "rljax":
            train_path = _write_jsonl(os.path.join(tmp, "train.jsonl"), train_rows)
            eval_path = _write_jsonl(os.path.join(tmp, "eval.jsonl"), eval_rows)
            out = run_rljax(train_path, eval_path, os.path.join(tmp, "run"), setting=setting, steps=args.steps,
                            batch=args.batch, eval_size=args.eval)
        else:
            out = run_trl(args.hf_dir, train_rows, eval_rows, os.path.join(tmp, "run"), setting=setting,
                          steps=args.steps, batch=args.batch)
    with open(args.result, "w") as f:
        json.dump(out, f)


def _report(args, rows, trl_error) -> None:
    """Write the table so far to ``args.out`` (after every row: a run cut short keeps what it measured)."""
    import jax

    from rljax.tools.reporting import environment, markdown_table

    table = markdown_table(["preference", "setting", "rljax held-out acc (before -> after)",
                            "TRL held-out acc (before -> after)", "rljax s/step", "TRL s/step",
                            "TRL / rljax time", "rljax train s", "TRL train s"], rows)
    env = environment()
    pk = env["packages"]
    text = (f"# rljax reward model vs TRL RewardTrainer\n\n"
            f"`experiments/rm_vs_trl.py --steps {args.steps} --batch {args.batch} --train {args.train} --eval {args.eval}` on "
            f"SmolLM2-135M-Instruct: {args.train} train pairs, {args.eval} held-out pairs per preference, "
            f"{args.steps} steps of {args.batch} pairs, one seed (0), float32 on {env['cpu_count']} CPU cores shared with other "
            f"jobs (load average {env['load_average'][0]:.1f} at the end), JAX {jax.default_backend()}.\n\n{table}\n\n"
            f"Versions: jax {pk.get('jax')}, flax {pk.get('flax')}, torch {pk.get('torch')}, transformers "
            f"{pk.get('transformers')}, trl {_version('trl')}, peft {_version('peft')}; commit {env['git_commit']}.\n")
    if trl_error:
        text += f"\nTRL side not run: {trl_error}\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text, flush=True)


def _version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
