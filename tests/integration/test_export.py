"""A model out of every run: RUN_DIR/model loads in transformers, RUN_DIR/adapter in peft, with
rljax's logits; ``rljax export`` writes the same from any checkpoint; ``rljax generate --checkpoint``."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from rljax.tools import cli  # noqa: E402
from rljax.config import from_yaml  # noqa: E402
from rljax.models.hf_io import load_hf_dir, model_from_params  # noqa: E402
from rljax.run_config import RunConfig  # noqa: E402
from rljax.training import OnlineTrainer  # noqa: E402

# float32 parity with transformers, as tests/integration/test_models_hf.py (random weights, logits of order 1)
ATOL = 1e-4
ROWS = [[5, 40, 41, 17, 33, 60, 9], [12, 7, 99, 3]]


def _cfg(tiny_dir, run_dir, *, steps, model=""):
    return from_yaml(RunConfig, f"""
model: {{name: {tiny_dir} {model}}}
data: {{task: addition, train_size: 32, eval_size: 0, max_prompt_length: 64}}
sampling: {{max_new_tokens: 6, engine: static}}  # its draws for this seed stop some rows early: rewards differ
algorithm: {{name: grpo, group_size: 4, prompts_per_step: 2}}
optim: {{learning_rate: 1.0e-2}}
train: {{steps: {steps}, run_dir: {run_dir}, progress: false, samples_every: null, save_every: 1}}
rewards: {{format: 1.0, length: 1.0}}
""")


@pytest.fixture(scope="module")
def full_run(tiny_dir, tmp_path_factory):
    """Full fine-tuning, two steps (checkpoints 1 and 2); a copy of the step-1 model kept in memory."""
    run_dir = str(tmp_path_factory.mktemp("full") / "run")
    trainer = OnlineTrainer(_cfg(tiny_dir, run_dir, steps=2))
    kept = {}
    step_once = trainer.step_once

    def step_and_keep():
        metrics = step_once()
        # a copy: the next update donates (reuses) the parameters' buffers
        kept[trainer.step] = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(trainer.run.policy.model())))
        return metrics

    trainer.step_once = step_and_keep
    summary = trainer.fit()
    step1 = model_from_params(trainer.run.model_config, kept[1])
    return run_dir, summary, step1, trainer.run.policy.model()


@pytest.fixture(scope="module")
def lora_run(tiny_dir, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("lora") / "run")
    trainer = OnlineTrainer(_cfg(tiny_dir, run_dir, steps=1, model=", lora_rank: 4, lora_alpha: 8.0"))
    summary = trainer.fit()
    return run_dir, summary, trainer.run.policy.model()


def _ours(model, row):
    return np.asarray(model(jnp.asarray([row])))[0]


def _torch_logits(model, row):
    with torch.no_grad():
        return model(torch.tensor([row])).logits[0].float().numpy()


def _hf(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def test_online_full_run_writes_a_model_transformers_loads_with_the_same_logits(full_run, tiny_dir):
    run_dir, summary, _, final = full_run
    assert summary["model_dir"] == os.path.join(run_dir, "model")
    assert "adapter_dir" not in summary and not os.path.exists(os.path.join(run_dir, "adapter"))
    hf, base = _hf(summary["model_dir"]), load_hf_dir(tiny_dir)
    for row in ROWS:
        ours = _ours(final, row)
        np.testing.assert_allclose(_torch_logits(hf, row), ours, atol=ATOL, rtol=0)
        assert np.abs(ours - _ours(base, row)).max() > 100 * ATOL  # trained: not the base model


def test_lora_run_writes_merged_model_and_a_peft_adapter_with_the_same_logits(lora_run, tiny_dir):
    run_dir, summary, policy = lora_run
    assert summary["adapter_dir"] == os.path.join(run_dir, "adapter")
    with open(os.path.join(run_dir, "adapter", "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (4, 8.0, "CAUSAL_LM")
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    merged = _hf(summary["model_dir"])
    adapted = peft.PeftModel.from_pretrained(_hf(tiny_dir), os.path.join(run_dir, "adapter")).eval()
    base = load_hf_dir(tiny_dir)
    for row in ROWS:
        ours = _ours(policy, row)  # rljax's adapted model, adapters not merged
        assert np.abs(ours - _ours(base, row)).max() > 100 * ATOL  # the adapters changed the model
        np.testing.assert_allclose(_torch_logits(merged, row), ours, atol=ATOL, rtol=0)
        np.testing.assert_allclose(_torch_logits(adapted, row), ours, atol=ATOL, rtol=0)


def test_export_writes_any_checkpoint(full_run, tmp_path, capsys):
    run_dir, _, step1, final = full_run
    out = str(tmp_path / "out")
    assert cli.main(["export", run_dir, "--step", "1", out]) == 0
    assert sorted(os.listdir(out)) == ["model"]
    exported = load_hf_dir(os.path.join(out, "model"))
    for row in ROWS:  # the step-1 parameters, bit for bit (float32 written, float32 read)
        np.testing.assert_array_equal(_ours(exported, row), _ours(step1, row))
        assert not np.array_equal(_ours(exported, row), _ours(final, row))
    # a non-empty OUT is refused unless --overwrite; then the latest step equals RUN_DIR/model
    with pytest.raises(SystemExit, match="is not empty .*--overwrite"):
        cli.main(["export", run_dir, out])
    assert cli.main(["export", run_dir, out, "--overwrite"]) == 0
    latest = load_hf_dir(os.path.join(out, "model"))
    np.testing.assert_array_equal(_ours(latest, ROWS[0]), _ours(final, ROWS[0]))
    # a step that is not there is one line naming the steps that are
    assert cli.main(["export", run_dir, "--step", "7", str(tmp_path / "other")]) == 2
    assert "no checkpoint for step 7" in capsys.readouterr().err


def test_export_of_a_lora_run_writes_the_adapter(lora_run, tmp_path):
    run_dir, _, _ = lora_run
    assert cli.main(["export", run_dir, str(tmp_path)]) == 0
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        with open(os.path.join(run_dir, "adapter", name), "rb") as a, open(tmp_path / "adapter" / name, "rb") as b:
            assert a.read() == b.read()


def test_generate_from_a_checkpoint_equals_generate_from_the_exported_model(full_run, capsys):
    run_dir, summary, _, _ = full_run
    args = ["--prompt", "2+3=", "--max-new-tokens", "6"]
    assert cli.main(["generate", "--checkpoint", run_dir, *args]) == 0
    from_checkpoint = capsys.readouterr()
    assert "checkpoint step 2" in from_checkpoint.err
    assert cli.main(["generate", "--model", summary["model_dir"], *args]) == 0
    assert capsys.readouterr().out == from_checkpoint.out


@pytest.mark.parametrize("max_slots,slots", [(64, 4), (3, 3)])
def test_generate_holds_the_pages_its_rows_can_use(tiny_dir, monkeypatch, capsys, max_slots, slots):
    # The paged engine allocates and zero-fills its pool up front: rljax generate sizes it for its rows
    # (min(--max-slots, prompts x samples) slots of the longest prompt + --max-new-tokens), not from
    # the host's free memory (gigabytes for a few tokens).
    from rljax import inference
    from rljax.models import load

    built = []

    class Recording(inference.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(inference, "Engine", Recording)
    assert cli.main(["generate", "--model", tiny_dir, "--prompt", "2+3=", "--prompt", "12+35+7=", "--num-samples", "2",
                     "--max-new-tokens", "20", "--max-slots", str(max_slots)]) == 0
    assert capsys.readouterr().out.count("--- [") == 4
    (engine,) = built
    _, tokenizer = load(tiny_dir)
    longest = len(tokenizer("12+35+7=")["input_ids"]) + 20  # raw prompts get the tokenizer's special tokens
    assert engine.max_slots == slots and engine.max_context == longest
    assert engine.stats["num_pages"] == slots * -(-longest // engine.page_size) + 1  # + the reserved null page
