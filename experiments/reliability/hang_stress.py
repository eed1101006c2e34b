"""Do two-process runs hang under CPU load? Repeats one two-process GRPO run under a CPU burner.

The question behind rljax/training/online.py's jitted advantages and reward-KL (docs/hangs-and-lost-processes.md):
eager op-by-op programs over arrays split across processes once hung a two-process run under CPU load, at
random, a few times in many tries. A single try proves little, so this stress loop repeats it; the test
suite keeps one loaded two-process run (tests/system/test_hangs.py) and the injected-hang tests.

    PYTHONPATH=. python experiments/reliability/hang_stress.py [--tries 10] [--hang-guard-s 900]

Each try: `python -m rljax train` as 2 processes x 4 simulated CPU devices (mesh fsdp=4, tensor=2) joined
over 127.0.0.1, 2 GRPO steps of the tiny random model (rljax.models.tiny) on the addition task, while a
third process spins a CPU core (`while True: pass`). A try "hangs" when both processes have not exited
after ``--hang-guard-s`` seconds (an idle try takes ~35 s, ~140 s on a loaded 2-core host); the
processes then get SIGABRT, whose Python stacks (PYTHONFAULTHANDLER) land in the try's logs. Prints
one line per try and a summary; exits 1 when any try hung or failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from rljax.models.tiny import make_tiny_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the run of one try; tests/system/test_hangs.py runs it too (one loaded try, a killed process, injected hangs)
GRPO = """
model: {{name: {model}}}
data: {{task: addition, train_size: 32, eval_size: 4, max_prompt_length: 64}}
sampling: {{max_new_tokens: 6}}
algorithm: {{name: grpo, group_size: 4, prompts_per_step: 2, micro_batch_size: 4, kl_coef: 0.01}}
optim: {{learning_rate: 1.0e-4}}
train: {{steps: {steps}, run_dir: unused, progress: false, plot: false, save_model: false}}
rewards: {rewards}
"""
LENGTH = "{length: {weight: 1.0, unit: chars, normalize: 20}}"


def one_try(config, run_dir, *, hang_guard_s):
    """``(outcome, seconds)``: ``"ok"``, ``"hung"`` or ``"failed (status ...)"`` for one two-process run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=REPO, RLJAX_PLOT="0", PYTHONFAULTHANDLER="1")
    os.makedirs(run_dir + ".logs", exist_ok=True)
    procs, start = [], time.monotonic()
    for i in range(2):
        argv = [sys.executable, "-m", "rljax", "train", config, f"train.run_dir={run_dir}", "mesh.fsdp=4",
                "mesh.tensor=2", "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
                "--process-id", str(i)]
        with open(os.path.join(run_dir + ".logs", f"process{i}.log"), "w") as log:
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO))
    try:
        for p in procs:
            p.wait(timeout=max(1.0, hang_guard_s - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGABRT)
                p.wait(timeout=60)
        return "hung", time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    return ("ok" if codes == [0, 0] else f"failed (status {codes})"), time.monotonic() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--hang-guard-s", type=float, default=900.0)
    parser.add_argument("--out", default=None, help="folder for the run directories and logs (default: a temporary one)")
    args = parser.parse_args(argv)
    root = args.out or tempfile.mkdtemp(prefix="hang_stress_")
    model = make_tiny_model_dir(os.path.join(root, "model"))
    config = os.path.join(root, "run.yaml")
    with open(config, "w") as f:
        f.write(GRPO.format(model=model, steps=2, rewards=LENGTH))
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    outcomes = []
    try:
        for k in range(args.tries):
            outcome, seconds = one_try(config, os.path.join(root, f"run{k}"), hang_guard_s=args.hang_guard_s)
            outcomes.append(outcome)
            print(f"try {k + 1}/{args.tries}: {outcome} in {seconds:.0f} s", flush=True)
    finally:
        burner.kill()
        burner.wait()
    hung = sum(o == "hung" for o in outcomes)
    print(f"{hung} of {len(outcomes)} hung, {sum(o.startswith('failed') for o in outcomes)} failed; logs in {root}")
    return 0 if all(o == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
