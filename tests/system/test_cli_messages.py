"""The last line a user sees names the cause.

Each test injects one mistake a careless user makes (a missing data file, a broken override, a
typo in ``--checkpoint``, a bad ``generate`` flag, a full disk) and checks the message: the key,
file or flag, and nothing misleading after it.
"""

import os
import subprocess
import sys
import textwrap

import pytest

import rljax.tools.cli
from rljax.config import ConfigError, load_config
from rljax.errors import MissingFileError, UserError
from rljax.run_config import RunConfig
from rljax.training.data import offline_rows, online_examples
from tests._tiny import make_tiny_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DPO = os.path.join(REPO, "configs", "dpo_smollm2_arith.yaml")
GRPO = os.path.join(REPO, "configs", "grpo_smollm2_arith.yaml")


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("RLJAX_TRACEBACK", None)
    return env


# ----------------------------------------------------------------------------- data files


@pytest.mark.parametrize("key", ["data.path", "data.eval_path"])
def test_missing_data_file_is_named_under_its_key(tmp_path, key):
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    missing = str(tmp_path / "data" / "trian.jsonl")
    paths = {"data.path": str(tmp_path / "pairs.jsonl"), "data.eval_path": ""} | {key: missing}
    cfg = load_config(RunConfig, DPO, ["data.task=", *(f"{k}={v}" for k, v in paths.items())])
    with pytest.raises(MissingFileError, match=f"^{key}: no such file: {missing}$"):
        offline_rows(cfg, "pairs")


def test_a_relative_file_name_without_a_directory_is_a_file_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(RunConfig, GRPO, ["data.task=", "data.path=prompts.parquet"])
    with pytest.raises(MissingFileError, match="^data.path: no such file: prompts.parquet$"):
        online_examples(cfg)


def test_a_data_set_name_that_cannot_be_reached_says_so(monkeypatch):
    import datasets

    def offline(*args, **kwargs):  # what datasets raises offline for a name it has not cached
        raise ConnectionError("Couldn't reach 'someone/prompts' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    cfg = load_config(RunConfig, GRPO, ["data.task=", "data.path=someone/prompts"])
    with pytest.raises(UserError, match="data.path 'someone/prompts' is neither a file nor a data set available "
                                        "offline"):
        online_examples(cfg)


def test_train_with_a_missing_data_file_ends_with_one_line(tmp_path, capsys):
    missing = str(tmp_path / "trian.jsonl")
    status = rljax.tools.cli.main(["train", DPO, "data.task=", f"data.path={missing}", f"train.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert status == 2
    assert _last_line(err) == f"rljax train: error: data.path: no such file: {missing}"
    assert "Traceback" not in err and "Hub" not in err


# ----------------------------------------------------------------------------- overrides


def test_a_yaml_error_in_an_override_names_the_override(capsys):
    with pytest.raises(ConfigError, match=r"override 'algorithm.group_size=\[1,': algorithm.group_size: "
                                          r"the value '\[1,' is not valid YAML"):
        load_config(RunConfig, GRPO, ["algorithm.group_size=[1,"])
    assert rljax.tools.cli.main(["train", GRPO, "algorithm.group_size=[1,"]) == 2
    assert _last_line(capsys.readouterr().err).startswith(
        "rljax train: error: override 'algorithm.group_size=[1,': algorithm.group_size: ")


def test_an_empty_override_is_the_empty_string_and_null_stays_null():
    cfg = load_config(RunConfig, DPO, ["data.task=", "data.path=pairs.jsonl"])
    assert cfg.data.task == "" and cfg.data.path == "pairs.jsonl"
    assert load_config(RunConfig, DPO, ['data.task=""', "data.path=x.jsonl"]).data.task == ""
    # a number cannot be empty; null is still null where the field allows it
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(RunConfig, GRPO, ["train.steps="])
    assert load_config(RunConfig, GRPO, ["optim.grad_clip=null"]).optim.grad_clip is None


def _shell_words(command: str) -> list[str]:
    """The argument list bash hands a program for ``command``."""
    out = subprocess.run(["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, check=True).stdout
    return out.decode().split("\0")[:-1]


def test_the_readme_form_survives_a_shell():
    with open(os.path.join(REPO, "docs", "offline.md")) as f:
        readme = f.read()
    start = readme.index("`rljax train configs/dpo_smollm2_arith.yaml 'data.task=")
    command = readme[start + 1: readme.index("`", start + 1)]
    words = _shell_words(command)
    assert words[:3] == ["rljax", "train", "configs/dpo_smollm2_arith.yaml"]
    cfg = load_config(RunConfig, os.path.join(REPO, words[2]), words[3:])
    assert cfg.data.task == "" and cfg.data.path == "OUT.jsonl"
    # the unquoted form loses its quotes in the shell and still means the empty string
    assert _shell_words('data.task="" data.path=OUT.jsonl') == ["data.task=", "data.path=OUT.jsonl"]
    assert load_config(RunConfig, DPO, _shell_words('data.task="" data.path=OUT.jsonl')).data.task == ""
    help_text = rljax.tools.cli.build_parser()._subparsers._group_actions[0].choices["pairs"].format_help()
    assert "'data.task=\"\"' data.path=OUT.jsonl" in " ".join(help_text.split())


# ----------------------------------------------------------------------------- eval --checkpoint


def test_eval_checkpoint_typo_creates_nothing_and_names_the_directory(tmp_path, capsys):
    typo = tmp_path / "rnus" / "grpo"
    assert rljax.tools.cli.main(["eval", GRPO, "--checkpoint", str(typo)]) == 2
    err = capsys.readouterr().err
    assert _last_line(err) == f"rljax eval: error: --checkpoint {typo}: no such run directory"
    assert not (tmp_path / "rnus").exists() and "--resume" not in err

    empty = tmp_path / "run"
    empty.mkdir()
    assert rljax.tools.cli.main(["eval", GRPO, "--checkpoint", str(empty)]) == 2
    err = capsys.readouterr().err
    assert _last_line(err) == f"rljax eval: error: --checkpoint {empty}: no checkpoint in {empty / 'checkpoints'}"
    assert os.listdir(empty) == [] and "--resume" not in err


# ----------------------------------------------------------------------------- generate flags


@pytest.mark.parametrize("flag,value,message", [
    ("--prompt", "", "argument --prompt: must not be empty"),
    ("--prompt", "  ", "argument --prompt: must not be empty"),
    ("--temperature", "nan", "argument --temperature: must be a finite number >= 0"),
    ("--temperature", "-0.5", "argument --temperature: must be a finite number >= 0"),
    ("--temperature", "inf", "argument --temperature: must be a finite number >= 0"),
    ("--top-p", "0", "argument --top-p: must be in (0, 1], got 0"),
    ("--top-p", "1.5", "argument --top-p: must be in (0, 1], got 1.5"),
    ("--top-p", "nan", "argument --top-p: must be in (0, 1], got nan"),
    ("--top-k", "-1", "argument --top-k: must be >= 0, got -1"),
    ("--num-samples", "0", "argument --num-samples: must be at least 1, got 0"),
    ("--num-samples", "-2", "argument --num-samples: must be at least 1, got -2"),
    ("--num-samples", "two", "argument --num-samples: expected an integer, got 'two'"),
    ("--max-new-tokens", "0", "argument --max-new-tokens: must be at least 1, got 0"),
])
def test_generate_refuses_bad_flags_before_loading_a_model(capsys, flag, value, message):
    argv = ["generate", "--model", "no-such-model"] + (["--prompt", "hi"] if flag != "--prompt" else [])
    with pytest.raises(SystemExit) as exit_info:
        rljax.tools.cli.main([*argv, f"{flag}={value}"])
    assert exit_info.value.code == 2
    assert _last_line(capsys.readouterr().err).startswith(f"rljax generate: error: {message}")


# ----------------------------------------------------------------------------- user errors vs bugs


def test_user_error_is_one_line_and_status_2_unless_rljax_traceback(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "nope.yaml"
    assert rljax.tools.cli.main(["train", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == f"rljax train: error: no such config file: {missing}\n"
    monkeypatch.setenv("RLJAX_TRACEBACK", "1")
    with pytest.raises(MissingFileError, match="no such config file"):
        rljax.tools.cli.main(["train", str(missing)])
    assert "RLJAX_TRACEBACK=1" in rljax.tools.cli.build_parser().format_help()


def test_an_unexpected_error_keeps_its_traceback(monkeypatch):
    import rljax.config

    def broken(*args, **kwargs):
        raise ValueError("a bug, not the user's input")

    monkeypatch.setattr(rljax.config, "load_config", broken)
    with pytest.raises(ValueError, match="a bug") as info:
        rljax.tools.cli.main(["train", GRPO])
    assert not isinstance(info.value, UserError)


_TEARDOWN_NOISE = textwrap.dedent("""
    import sys
    import rljax.tools.cli

    class LeftBehind:  # like orbax's writer coroutines after a failed save: finalised at exit
        def __del__(self):
            raise ImportError("sys.meta_path is None, Python is likely shutting down")

    left_behind = LeftBehind()  # held by a module: finalised when the interpreter shuts down
    sys.exit(rljax.tools.cli.main(sys.argv[1:]) if len(sys.argv) > 1 else 1)
""")


def test_teardown_noise_does_not_follow_the_error(tmp_path):
    script = tmp_path / "noise.py"
    script.write_text(_TEARDOWN_NOISE)
    without_cli = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_env())
    assert "sys.meta_path is None" in without_cli.stderr  # the noise the CLI must keep after its error
    missing = tmp_path / "nope.yaml"
    done = subprocess.run([sys.executable, str(script), "train", str(missing)], capture_output=True, text=True,
                          env=_env())
    assert done.returncode == 2
    assert done.stderr == f"rljax train: error: no such config file: {missing}\n"


_DISK_FULL = textwrap.dedent("""
    import resource, sys
    import numpy as np
    import rljax.tools.cli
    from rljax.rewards.base import register_reward

    def lowercase(completions, examples):
        return np.array([sum(c.islower() for c in t) / max(len(t), 1) for t in completions])

    register_reward("lowercase_batch", lambda: lowercase, overwrite=True)
    limit = 200 * 1024  # bytes per file: the config and metrics fit, a checkpoint's arrays do not
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    sys.exit(rljax.tools.cli.main(["train", sys.argv[1]]))
""")


@pytest.mark.heavy  # ~20 s of CPU (a tiny run in a subprocess); the teardown test above is its quick form
def test_a_failed_checkpoint_write_is_the_last_thing_printed(tmp_path):
    model = make_tiny_model_dir(tmp_path / "model")
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent(f"""
        model: {{name: {model}}}
        data: {{task: addition, train_size: 16, eval_size: 2, max_prompt_length: 64}}
        sampling: {{max_new_tokens: 4}}
        algorithm: {{name: grpo, group_size: 2, prompts_per_step: 2, micro_batch_size: 4}}
        train: {{steps: 2, run_dir: {tmp_path / 'run'}, progress: false, save_every: 1}}
        rewards: {{lowercase_batch: 1.0}}
    """))
    script = tmp_path / "disk_full.py"
    script.write_text(_DISK_FULL)
    done = subprocess.run([sys.executable, str(script), str(config)], capture_output=True, text=True, env=_env())
    assert done.returncode == 1, done.stderr[-3000:]
    assert "File too large" in _last_line(done.stderr), done.stderr[-3000:]
    assert "sys.meta_path is None" not in done.stderr and "Exception ignored" not in done.stderr


# ----------------------------------------------------------------------------- transformers without torch

# As if torch were not installed (rljax needs none): `import torch` fails and transformers'
# `is_torch_available()` is False, so importing transformers prints its "PyTorch was not found" advisory.
_NO_TORCH = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None
    if sys.argv[1] == "import":
        import transformers
    else:
        import rljax.tools.cli
        assert "transformers" not in sys.modules, "importing rljax.tools.cli imported transformers"
        sys.exit(rljax.tools.cli.main(sys.argv[1:]))
""")


def test_commands_do_not_print_the_pytorch_not_found_advisory(tmp_path):
    model = make_tiny_model_dir(tmp_path / "model")
    script = tmp_path / "no_torch.py"
    script.write_text(_NO_TORCH)
    env = _env()
    env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    plain = subprocess.run([sys.executable, str(script), "import"], capture_output=True, text=True, env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "PyTorch was not found" in plain.stderr  # the advisory the commands must silence
    done = subprocess.run([sys.executable, str(script), "generate", "--model", model, "--prompt", "2+3=",
                           "--max-new-tokens", "2"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PyTorch" not in done.stderr, done.stderr[-3000:]


# The `rljax` command, with a note at exit of the heavy modules it imported. With torch installed (as in
# the test extra) a command must not import it: rljax needs none, and transformers' AutoTokenizer module
# imports it (rljax.models.hf_io). `rljax --help` runs no JAX, so it must not import it either.
_IMPORTED_AT_EXIT = textwrap.dedent("""
    import atexit
    import sys
    atexit.register(lambda: print("imported:", *(m for m in ("jax", "torch") if m in sys.modules), file=sys.stderr))
    import rljax.tools.cli
    sys.exit(rljax.tools.cli.main(sys.argv[1:]))
""")


def _imported_at_exit(tmp_path, *args):
    script = tmp_path / "imported_at_exit.py"
    script.write_text(_IMPORTED_AT_EXIT)
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return _last_line(done.stderr).split()[1:]


def test_a_command_on_a_tiny_model_does_not_import_torch(tmp_path):
    pytest.importorskip("torch")  # installed, so a command could import it
    model = make_tiny_model_dir(tmp_path / "model")
    assert _imported_at_exit(tmp_path, "generate", "--model", model, "--prompt", "2+3=", "--max-new-tokens", "2") == ["jax"]


def test_help_imports_no_jax(tmp_path):
    assert _imported_at_exit(tmp_path, "--help") == []
