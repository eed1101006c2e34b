"""``rljax plan`` of every registered algorithm on the CPU target: the plan compiles the batch the
trainer would build (its data kind's own shapes), whatever the algorithm."""

import dataclasses
import json

import pytest

from rljax.algorithms import ALGORITHMS
from rljax.config import from_yaml
from rljax.run_config import RunConfig
from rljax.tools.plan import format_report, plan_run

TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "max_position_embeddings": 256, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}
# embed + lm_head 2·256·32, wq/wo 2·32·32, wk/wv 2·32·16, MLP 3·32·64, three norms of 32
TINY_PARAMS = 2 * 256 * 32 + 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 3 * 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY))
    return str(path)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_plan_compiles_every_registered_algorithm_on_the_cpu_target(model_dir, name):
    algorithm = ALGORITHMS[name]
    fields = {f.name for f in dataclasses.fields(algorithm.config)}
    section = f"name: {name}" + (", group_size: 2, prompts_per_step: 2" if algorithm.online else ", batch_size: 2, "
                                 "eval_batch_size: 2, max_completion_length: 16")
    if "kl_coef" in fields:
        section += ", kl_coef: 0.05"  # a reference: the scoring program too
    cfg = from_yaml(RunConfig, f"""
model: {{name: {model_dir}}}
data: {{max_prompt_length: 16}}
sampling: {{max_new_tokens: 16}}
algorithm: {{{section}}}
mesh: {{fsdp: 1}}
rewards: {{answer: 1.0}}
""" if algorithm.online else f"""
model: {{name: {model_dir}}}
data: {{max_prompt_length: 16}}
algorithm: {{{section}}}
mesh: {{fsdp: 1}}
""")
    report = plan_run(cfg, "cpu-1", memory_bytes=2 ** 34)
    programs = {p.name: p for p in report.programs}
    assert "update" in programs and report.fits
    assert programs["update"].argument_bytes > 0 and programs["update"].flops
    if algorithm.online:
        assert "engine prefill" in programs and "engine decode" in programs
    assert ("scoring" in programs) == algorithm.needs_reference(cfg.algorithm)
    has_head = (algorithm.value_head(cfg.algorithm) == "shared") if algorithm.online else algorithm.value_head
    assert report.num_params == TINY_PARAMS + (33 if has_head else 0)  # a value head: w [32] and b [1]
    text = format_report(report)
    assert f"parameters {report.num_params / 1e3:.3g} K" in text and "0.000 B" not in text


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_an_off_policy_correction_adds_the_trainers_pi_old_scoring_pass(model_dir, kl_coef):
    """With ``off_policy_correction`` the trainer scores each batch under π_old before the update
    (``rljax.training.online``'s step), a forward pass the step pays beside the reference's: the plan
    compiles it and counts it in the step."""
    cfg = from_yaml(RunConfig, f"""
model: {{name: {model_dir}}}
data: {{max_prompt_length: 16}}
sampling: {{max_new_tokens: 16}}
algorithm: {{name: grpo, group_size: 2, prompts_per_step: 2, kl_coef: {kl_coef}, off_policy_correction: seq_mask}}
mesh: {{fsdp: 1}}
rewards: {{answer: 1.0}}
""")
    report = plan_run(cfg, "cpu-1", memory_bytes=2 ** 34)
    scoring = [p.what for p in report.programs if p.name == "scoring"]
    assert [w.split(" log-probs")[0] for w in scoring] == (["score_logprobs: π_old"] + (
        ["score_logprobs: reference"] if kl_coef else []))
    assert "off_policy_correction: seq_mask" in scoring[0]
    assert all(p.in_step for p in report.programs if p.name == "scoring")
