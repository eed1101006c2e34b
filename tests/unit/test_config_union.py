"""Tagged unions of dataclass sections in rljax.config: choosing the member, errors, round trip."""

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import pytest

from rljax.config import (
    ConfigError,
    from_yaml,
    load_config,
    save_config,
    to_yaml,
    union_members,
    validate_config,
    with_overrides,
)

# ---------------------------------------------------------------------------- a small schema


@dataclass(frozen=True)
class GRPOSection:
    name: Literal["grpo"] = "grpo"
    clip_eps: float = 0.2
    loss_reduction: Literal["token", "sequence"] = "token"


@dataclass(frozen=True)
class PPOSection:
    name: Literal["ppo"] = "ppo"
    clip_eps: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95

    def validate(self) -> None:
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam ({self.lam}) must be in [0, 1]")


@dataclass(frozen=True)
class ReinforcePPSection:
    name: Literal["reinforce_pp"] = "reinforce_pp"
    gamma: float = 1.0
    baseline: Literal["batch", "group"] = "batch"


Algorithm = GRPOSection | PPOSection | ReinforcePPSection


@dataclass(frozen=True)
class RunConfig:
    name: str = "???"
    seed: int = 0
    algorithm: Algorithm = field(default_factory=GRPOSection)
    learning_rate: float = 1e-5
    tags: tuple[str, ...] = ()


def _error(*args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, *args, **kwargs)
    return info.value


# ---------------------------------------------------------------------------- choosing the member


def test_default_member_and_plain_frozen_result():
    cfg = load_config(RunConfig, None, ["name=x"])
    assert type(cfg) is RunConfig and type(cfg.algorithm) is GRPOSection
    assert cfg == RunConfig(name="x", algorithm=GRPOSection())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.algorithm.clip_eps = 0.3  # type: ignore[misc]
    # Hashable (a static jit argument), equal configs hash equal, dataclasses.replace works.
    assert hash(cfg) == hash(load_config(RunConfig, None, ["name=x"]))
    replaced = dataclasses.replace(cfg, algorithm=PPOSection(gamma=0.5))
    validate_config(replaced)
    assert {cfg: 1, replaced: 2}[replaced] == 2


def test_member_from_yaml(tmp_path):
    path = tmp_path / "ppo.yaml"
    path.write_text("name: x\nalgorithm:\n  name: ppo\n  gamma: 0.9\n")
    cfg = load_config(RunConfig, path)
    assert type(cfg.algorithm) is PPOSection
    assert cfg.algorithm == PPOSection(gamma=0.9)


def test_member_from_override():
    cfg = load_config(
        RunConfig, None, ["name=x", "algorithm.name=reinforce_pp", "algorithm.baseline=group"]
    )
    assert cfg.algorithm == ReinforcePPSection(baseline="group")
    # The tag may also follow the member's settings: the last tag written decides.
    cfg = load_config(RunConfig, None, ["name=x", "algorithm.gamma=0.5", "algorithm.name=ppo"])
    assert cfg.algorithm == PPOSection(gamma=0.5)
    cfg = load_config(RunConfig, None, ["name=x", "algorithm={name: ppo, lam: 0.5}"])
    assert cfg.algorithm == PPOSection(lam=0.5)


def test_override_changes_the_member_written_in_yaml(tmp_path):
    path = tmp_path / "ppo.yaml"
    path.write_text("name: x\nlearning_rate: 3e-5\nalgorithm:\n  name: ppo\n  clip_eps: 0.1\n")
    cfg = load_config(RunConfig, path, ["algorithm.name=grpo"])
    # The YAML's shared key applies on top of the new member's defaults.
    assert cfg.algorithm == GRPOSection(clip_eps=0.1) and cfg.learning_rate == 3e-5
    # A key the YAML writes for the member it named, which the final member lacks, is refused.
    path.write_text("name: x\nalgorithm:\n  name: ppo\n  gamma: 0.9\n")
    err = _error(path, ["algorithm.name=grpo"])
    assert err.key == "algorithm.gamma" and err.source == str(path)
    assert err.reason.endswith(
        "'gamma' is a setting of ppo, reinforce_pp and does nothing for algorithm 'grpo'"
    )


# ---------------------------------------------------------------------------- errors


def test_key_of_another_member_is_refused_with_the_member_that_has_it():
    err = _error(None, ["name=x", "algorithm.gamma=0.9"])
    assert err.key == "algorithm.gamma"
    assert str(err) == (
        "override 'algorithm.gamma=0.9': algorithm.gamma: unknown key for GRPOSection "
        "(known keys: name, clip_eps, loss_reduction); 'gamma' is a setting of ppo, "
        "reinforce_pp and does nothing for algorithm 'grpo'"
    )
    err = _error(None, ["name=x", "algorithm.name=reinforce_pp", "algorithm.lam=0.9"])
    assert err.key == "algorithm.lam"
    assert err.reason.endswith(
        "'lam' is a setting of ppo and does nothing for algorithm 'reinforce_pp'"
    )
    # A key no member has gets the usual spelling hint.
    err = _error(None, ["name=x", "algorithm.clip_ep=0.1"])
    assert err.key == "algorithm.clip_ep"
    assert err.reason.endswith(
        "(known keys: name, clip_eps, loss_reduction); did you mean 'clip_eps'?"
    )


def test_unknown_tag_lists_the_allowed_ones(tmp_path):
    err = _error(None, ["name=x", "algorithm.name=ppx"])
    assert err.key == "algorithm.name" and err.source == "override 'algorithm.name=ppx'"
    assert err.reason == "unknown tag 'ppx' (allowed: grpo, ppo, reinforce_pp); did you mean 'ppo'?"
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nalgorithm: {name: sft}\n")
    err = _error(path)
    assert err.key == "algorithm.name" and err.source == str(path)
    assert err.reason == "unknown tag 'sft' (allowed: grpo, ppo, reinforce_pp)"
    # A tag given where the section goes.
    err = _error(None, ["name=x", "algorithm=ppo"])
    assert err.key == "algorithm"
    assert err.reason == (
        "expected a mapping whose 'name' is one of [grpo, ppo, reinforce_pp], got 'ppo'; "
        "to choose one, set algorithm.name=ppo"
    )


def test_type_and_literal_errors_inside_a_member_name_the_key_and_source(tmp_path):
    err = _error(None, ["name=x", "algorithm.loss_reduction=tokens"])
    assert err.key == "algorithm.loss_reduction" and "'token', 'sequence'" in err.reason
    assert str(err).startswith(
        "override 'algorithm.loss_reduction=tokens': algorithm.loss_reduction: "
    )
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nalgorithm:\n  name: ppo\n  gamma: high\n")
    err = _error(path)
    assert err.key == "algorithm.gamma" and err.source == str(path) and "Float" in err.reason


def test_member_validate_runs_and_is_reported_under_the_section():
    err = _error(None, ["name=x", "algorithm.name=ppo", "algorithm.lam=2"])
    assert err.key == "algorithm" and str(err) == "algorithm: lam (2.0) must be in [0, 1]"
    cfg = load_config(RunConfig, None, ["name=x"])
    with pytest.raises(ConfigError, match=r"^algorithm: lam \(-1.0\) must be in \[0, 1\]$"):
        validate_config(dataclasses.replace(cfg, algorithm=PPOSection(lam=-1.0)))
    with pytest.raises(ConfigError, match=r"^algorithm.loss_reduction: invalid value 'tok'"):
        validate_config(dataclasses.replace(cfg, algorithm=GRPOSection(loss_reduction="tok")))
    with pytest.raises(
        ConfigError,
        match=r"^algorithm: expected one of GRPOSection, PPOSection, ReinforcePPSection, "
        r"got RunConfig$",
    ):
        validate_config(dataclasses.replace(cfg, algorithm=cfg))


# ---------------------------------------------------------------------------- round trip


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.clip_eps=0.3", "algorithm.loss_reduction=sequence"],
        ["algorithm.name=ppo", "algorithm.gamma=0.99", "algorithm.lam=0.5"],
        ["algorithm.name=reinforce_pp", "algorithm.baseline=group"],
    ],
)
def test_yaml_round_trip_for_each_member(tmp_path, overrides):
    cfg = load_config(RunConfig, None, ["name=x", "tags=[a]", *overrides])
    text = to_yaml(cfg)
    assert f"  name: {cfg.algorithm.name}\n" in text
    assert from_yaml(RunConfig, text) == cfg
    save_config(cfg, tmp_path / "run" / "config.yaml")
    loaded = load_config(type(cfg), tmp_path / "run" / "config.yaml")
    assert loaded == cfg and type(loaded.algorithm) is type(cfg.algorithm)


def test_with_overrides_switching_the_member_restarts_the_section():
    cfg = load_config(
        RunConfig,
        None,
        [
            "name=x",
            "learning_rate=3e-5",
            "algorithm.name=ppo",
            "algorithm.gamma=0.9",
            "algorithm.clip_eps=0.1",
        ],
    )
    same = with_overrides(cfg, ["algorithm.lam=0.5"])
    assert same.algorithm == PPOSection(clip_eps=0.1, gamma=0.9, lam=0.5)
    switched = with_overrides(cfg, ["algorithm.name=reinforce_pp"])
    # gamma is a setting of both but is not carried over: the section restarts from defaults.
    assert switched.algorithm == ReinforcePPSection() and switched.learning_rate == 3e-5
    switched = with_overrides(cfg, ["algorithm.name=grpo", "algorithm.clip_eps=0.3"])
    assert switched == dataclasses.replace(cfg, algorithm=GRPOSection(clip_eps=0.3))
    assert type(switched) is RunConfig
    with pytest.raises(ConfigError, match="'gamma' is a setting of ppo, reinforce_pp"):
        with_overrides(cfg, ["algorithm.name=grpo", "algorithm.gamma=0.5"])


# ---------------------------------------------------------------------------- nesting


@dataclass(frozen=True)
class MLPCritic:
    name: Literal["mlp"] = "mlp"
    hidden: int = 64


@dataclass(frozen=True)
class SharedCritic:
    name: Literal["shared"] = "shared"
    head_init_scale: float = 0.01


@dataclass(frozen=True)
class ActorCritic:
    name: Literal["actor_critic"] = "actor_critic"
    critic: MLPCritic | SharedCritic = field(default_factory=MLPCritic)


@dataclass(frozen=True)
class TrainSection:
    steps: int = 10
    algorithm: Union[GRPOSection, ActorCritic] = field(default_factory=GRPOSection)


@dataclass(frozen=True)
class NestedConfig:
    train: TrainSection = field(default_factory=lambda: TrainSection(algorithm=ActorCritic()))
    extra: Optional[TrainSection] = None


def test_unions_below_the_top_level():
    cfg = load_config(NestedConfig, None)
    assert cfg.train.algorithm == ActorCritic(critic=MLPCritic()) and cfg.extra is None
    cfg = load_config(
        NestedConfig, None, ["train.algorithm.critic.name=shared", "extra={steps: 2}"]
    )
    assert cfg.train.algorithm == ActorCritic(critic=SharedCritic())
    assert cfg.extra == TrainSection(steps=2, algorithm=GRPOSection())
    assert type(cfg.train) is TrainSection and type(cfg) is NestedConfig
    assert from_yaml(NestedConfig, to_yaml(cfg)) == cfg
    err = _error_nested(["train.algorithm.critic.hidden=8", "train.algorithm.critic.name=shared"])
    assert err.key == "train.algorithm.critic.hidden"
    assert err.reason.endswith("'hidden' is a setting of mlp and does nothing for critic 'shared'")
    cfg = load_config(
        NestedConfig, None, ["train.algorithm.name=grpo", "train.algorithm.clip_eps=0.5"]
    )
    assert cfg.train == TrainSection(algorithm=GRPOSection(clip_eps=0.5))
    err = _error_nested(["extra.algorithm.name=ppo"])
    assert err.key == "extra.algorithm.name" and "(allowed: grpo, actor_critic)" in err.reason


def _error_nested(overrides) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(NestedConfig, None, overrides)
    return info.value


# ---------------------------------------------------------------------------- schema errors


def test_union_members():
    assert union_members(Algorithm) == {
        "grpo": GRPOSection,
        "ppo": PPOSection,
        "reinforce_pp": ReinforcePPSection,
    }
    # Union[A, B] == Union[B, A]; the declared order is kept all the same.
    assert list(union_members(Union[PPOSection, GRPOSection])) == ["ppo", "grpo"]
    assert list(union_members(GRPOSection | PPOSection)) == ["grpo", "ppo"]
    with pytest.raises(TypeError, match="Union of two or more dataclasses"):
        union_members(GRPOSection)
    with pytest.raises(TypeError, match="Union of two or more dataclasses"):
        union_members(Optional[GRPOSection])


@dataclass(frozen=True)
class OtherGRPO:
    name: Literal["grpo"] = "grpo"


@dataclass(frozen=True)
class Untagged:
    clip_eps: float = 0.2


@dataclass(frozen=True)
class StrTagged:
    name: str = "untyped"


@dataclass(frozen=True)
class WrongDefault:
    name: Literal["wrong"] = "right"


@dataclass(frozen=True)
class DuplicateTags:
    algorithm: GRPOSection | OtherGRPO = field(default_factory=GRPOSection)


@dataclass(frozen=True)
class MemberWithoutTag:
    algorithm: GRPOSection | Untagged = field(default_factory=GRPOSection)


@dataclass(frozen=True)
class OptionalUnion:
    algorithm: Optional[GRPOSection | PPOSection] = None


@dataclass(frozen=True)
class ListOfUnions:
    algorithms: tuple[GRPOSection | PPOSection, ...] = ()


@dataclass(frozen=True)
class DefaultNotAMember:
    algorithm: GRPOSection | PPOSection = field(
        default_factory=ReinforcePPSection  # type: ignore[assignment]
    )


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (DuplicateTags, "members GRPOSection and OtherGRPO have the same tag 'grpo'"),
        (
            MemberWithoutTag,
            r"member Untagged needs a field `name: Literal\[\"<tag>\"\] = \"<tag>\"`",
        ),
        (OptionalUnion, "OptionalUnion.algorithm: a tagged union must be a Union of dataclasses"),
        (ListOfUnions, "ListOfUnions.algorithms: a tagged union must be the whole type"),
        (
            DefaultNotAMember,
            "DefaultNotAMember.algorithm: the default must be an instance of GRPOSection, "
            "PPOSection, got ReinforcePPSection",
        ),
    ],
)
def test_bad_union_schemas_raise_type_error(schema, message):
    with pytest.raises(TypeError, match=message):
        load_config(schema, None)


@pytest.mark.parametrize("member", [Untagged, StrTagged, WrongDefault])
def test_member_needs_a_single_literal_name_with_its_default(member):
    with pytest.raises(TypeError, match=f"member {member.__name__} needs a field"):
        union_members(GRPOSection | member)


@dataclass(frozen=True)
class MandatoryAlgorithm:
    algorithm: GRPOSection | PPOSection
    seed: int = 0


def test_union_without_default_must_be_chosen():
    with pytest.raises(ConfigError) as info:
        load_config(MandatoryAlgorithm, None)
    assert info.value.key == "algorithm.name"
    assert info.value.reason == "missing mandatory value; choose one of [grpo, ppo]"
    cfg = load_config(MandatoryAlgorithm, None, ["algorithm.name=ppo"])
    assert cfg == MandatoryAlgorithm(algorithm=PPOSection())


def test_a_key_that_moved_out_of_the_algorithm_section_names_its_new_place():
    # algorithm.save_model (offline runs, before every run wrote a model) is train.save_model now
    from rljax.run_config import RunConfig

    with pytest.raises(ConfigError) as err:
        from_yaml(RunConfig, "algorithm: {name: dpo, save_model: true}\n")
    assert err.value.key == "algorithm.save_model"
    assert err.value.reason.endswith("'save_model' moved to 'train.save_model'")


def test_an_open_union_reads_its_members_at_load_and_resolves_other_tags():
    from rljax.config import OpenUnion

    registry = {"grpo": GRPOSection}
    resolved = []

    @dataclass(frozen=True)
    class LaterSection:
        name: Literal["later"] = "later"
        depth: int = 1

    class Open(OpenUnion):
        @classmethod
        def members(cls):
            return dict(registry)

        @classmethod
        def resolve(cls, tag):
            resolved.append(tag)
            if tag == "outside:THING":
                registry[tag] = dataclasses.make_dataclass(
                    "Outside", [("name", Literal["outside:THING"], field(default="outside:THING")),
                                ("width", int, field(default=2))], frozen=True)
                return registry[tag]
            return None

    @dataclass(frozen=True)
    class Root:
        algorithm: Open = GRPOSection()  # type: ignore[assignment]

    with pytest.raises(ConfigError, match=r"algorithm\.name: unknown tag 'later' \(allowed: grpo\)"):
        from_yaml(Root, "algorithm: {name: later}")
    registry["later"] = LaterSection  # registered after the schema was defined: seen at the next load
    assert from_yaml(Root, "algorithm: {name: later, depth: 3}").algorithm == LaterSection(depth=3)
    cfg = from_yaml(Root, "algorithm: {name: 'outside:THING', width: 5}")
    assert type(cfg.algorithm).__name__ == "Outside" and cfg.algorithm.width == 5
    assert from_yaml(Root, to_yaml(cfg)) == cfg
    with pytest.raises(ConfigError, match=r"algorithm\.depth: unknown key for Outside .*'depth' is a setting of later"):
        from_yaml(Root, "algorithm: {name: 'outside:THING', depth: 5}")
    assert resolved == ["later", "outside:THING"]
