"""MetricsLogger: JSON lines written and flushed, resume truncation, TensorBoard, samples."""

import json
import math
import struct
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from rljax.metrics_log import METRICS_FILE, SAMPLES_FILE, MetricsLogger, read_jsonl


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metric_lines_are_strict_json_and_flushed(tmp_path):
    logger = MetricsLogger(tmp_path / "run", progress=False)
    logger.log(
        1,
        {
            "loss": jnp.float32(0.5),
            "loss_bf16": jnp.asarray(0.75, jnp.bfloat16),
            "reward/mean": np.float64(0.25),
            "tokens": jnp.int32(128),
            "lr": 1e-5,
            "clipped": np.bool_(True),
            "nan": jnp.array(jnp.nan),
            "inf": float("-inf"),
        },
    )
    # Readable before close: each line is flushed as it is written.
    text = (tmp_path / "run" / METRICS_FILE).read_text()
    record = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert record["step"] == 1 and isinstance(record["time"], float)
    assert record["loss"] == 0.5 and record["reward/mean"] == 0.25 and record["lr"] == 1e-5
    assert record["loss_bf16"] == 0.75
    assert record["tokens"] == 128 and isinstance(record["tokens"], int)
    assert record["clipped"] == 1
    assert record["nan"] is None and record["inf"] is None
    logger.log(2, {"loss": 0.25})
    logger.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / METRICS_FILE)] == [1, 2]


def test_bad_metrics_are_rejected(tmp_path):
    with MetricsLogger(tmp_path, progress=False) as logger:
        with pytest.raises(ValueError, match="'loss' must be a real scalar"):
            logger.log(1, {"loss": jnp.zeros(3)})
        with pytest.raises(ValueError, match="reserved"):
            logger.log(1, {"step": 3})
        with pytest.raises(ValueError, match="real scalar"):
            logger.log(1, {"name": "abc"})


def test_samples_are_appended_per_row(tmp_path):
    with MetricsLogger(tmp_path, progress=False) as logger:
        rows = [
            {"prompt": "2+2=", "completion": "4 ✓", "reward/math": jnp.float32(1.0),
             "tokens": np.array([5, 6], np.int32)},
            {"prompt": "1+1=", "completion": "3", "reward/math": float("nan"), "tokens": [7]},
        ]
        logger.log_samples(10, rows)
        logger.log_samples(20, rows[:1])
    got = _lines(tmp_path / SAMPLES_FILE)
    assert [r["step"] for r in got] == [10, 10, 20]
    assert got[0] == {"step": 10, "prompt": "2+2=", "completion": "4 ✓", "reward/math": 1.0,
                      "tokens": [5, 6]}
    assert got[1]["reward/math"] is None


def test_resume_appends_and_truncates_after_the_checkpoint_step(tmp_path):
    with MetricsLogger(tmp_path, progress=False) as logger:
        for step in range(1, 8):
            logger.log(step, {"loss": 1.0 / step})
            logger.log_samples(step, [{"prompt": "p", "completion": str(step)}])
    first_five = (tmp_path / METRICS_FILE).read_text().splitlines(keepends=True)[:5]
    # The crashed run also left a torn final line.
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 8, "lo')

    # Resume from the checkpoint at step 5.
    with MetricsLogger(tmp_path, progress=False) as logger:
        logger.truncate_after(5)
        assert (tmp_path / METRICS_FILE).read_text() == "".join(first_five)  # kept verbatim
        assert [r["completion"] for r in _lines(tmp_path / SAMPLES_FILE)] == list("12345")
        logger.log(6, {"loss": 0.0})
        logger.log_samples(6, [{"prompt": "p", "completion": "again"}])
    metrics = _lines(tmp_path / METRICS_FILE)
    assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5, 6]
    assert metrics[-1]["loss"] == 0.0 and math.isclose(metrics[1]["loss"], 0.5)
    assert _lines(tmp_path / SAMPLES_FILE)[-1] == {"step": 6, "prompt": "p", "completion": "again"}


def test_reopening_after_a_torn_line_starts_a_fresh_line(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    with MetricsLogger(tmp_path, progress=False) as logger:
        logger.log(2, {"loss": 0.5})
    assert [r["step"] for r in read_jsonl(tmp_path / METRICS_FILE)] == [1, 2]


def _read_events(path):
    """Events of a TensorBoard event file (TFRecord framing: u64 length, u32 crc, data, u32 crc)."""
    from tensorboardX.proto import event_pb2

    data, events, pos = path.read_bytes(), [], 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        events.append(event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length]))
        pos += 12 + length + 4
    return events


def test_tensorboard_events_are_written_when_asked_without_importing_torch(tmp_path):
    with MetricsLogger(tmp_path / "plain", progress=False) as logger:
        logger.log(1, {"loss": 1.0})
    assert not (tmp_path / "plain" / "tensorboard").exists()

    torch_was_loaded = "torch" in sys.modules
    with MetricsLogger(tmp_path / "tb", tensorboard=True, progress=False) as logger:
        logger.log(1, {"loss": 1.0, "kl/mean": float("nan")})
        logger.log(2, {"loss": 0.5})
        logger.truncate_after(1)  # reopens the writer with a purge marker at step 2
        logger.log(2, {"loss": 0.25})
    if not torch_was_loaded:
        assert "torch" not in sys.modules
    files = [_read_events(f) for f in (tmp_path / "tb" / "tensorboard").glob("events.out.*")]
    events = [e for f in sorted(files, key=lambda f: f[0].wall_time) for e in f]
    scalars = [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value]
    step_1 = sorted(s for s in scalars if s[0] == 1)  # tensorboardX may reorder within a step
    assert step_1[0][:2] == (1, "kl/mean") and math.isnan(step_1[0][2])
    assert step_1[1] == (1, "loss", 1.0)
    assert scalars[2:] == [(2, "loss", 0.5), (2, "loss", 0.25)]
    purges = [e.step for e in events if e.HasField("session_log")]
    assert purges == [2]  # TensorBoard hides the first run's step-2 point


def test_progress_bar_restarts_at_the_resumed_step_and_inactive_process(tmp_path, capsys):
    with MetricsLogger(tmp_path / "bar", total_steps=10, keys_in_bar=("loss",)) as logger:
        logger.log(1, {"loss": 0.123456, "other": 1.0})
        assert logger.progress_bar.n == 1 and logger.progress_bar.total == 10
        logger.truncate_after(4)  # resume from step 4
        assert logger.progress_bar.n == 4 and logger.progress_bar.initial == 4
        logger.log(5, {"loss": 0.5})
        assert logger.progress_bar.n == 5 and logger.progress_bar.postfix == "loss=0.5"
        logger.write("eval: accuracy 0.5")
    assert "eval: accuracy 0.5" in capsys.readouterr().out

    with MetricsLogger(tmp_path / "other_host", progress=False, active=False) as logger:
        logger.log(1, {"loss": 1.0})
        logger.log_samples(1, [{"prompt": "p"}])
        logger.truncate_after(0)
        assert logger.progress_bar is None
    assert not (tmp_path / "other_host").exists()
