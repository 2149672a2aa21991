"""Each option is declared once, as a config field: the CLI's flags, help, defaults, checks and
the resume settings are derived from the fields (``agentenv.options``)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from dataclasses import fields
from pathlib import Path

import pytest

from agentenv.cli import TrainRunConfig, build_parser
from agentenv.config import (
    HELP_GROUPS,
    ClusterOptions,
    EngineOptions,
    SANDBOX_LIMITS,
    EvalRunConfig,
    RolloutConfig,
    RolloutRunConfig,
    SamplingConfig,
    SandboxOptions,
    open_sandbox,
)
from agentenv.errors import ConfigError
from agentenv.options import (Concern, add_options, build, concern_of, flag_of, groups_of, option, option_of,
                              resume_settings, walk)
from agentenv.registry import describe
from agentenv.train.config import TrainConfig

COMMANDS = {"rollout": RolloutRunConfig, "eval": EvalRunConfig, "train": TrainRunConfig}


def subparser(name: str, argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = build_parser(argv or [name])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """dest -> flag of every option the parser takes (``--help`` aside)."""
    return {a.dest: a.option_strings[0] for a in parser._actions if a.dest != "help" and a.help != argparse.SUPPRESS}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_flag_is_a_config_field_and_every_field_a_flag(name):
    cls = COMMANDS[name]
    options = {path: f for path, f, _ in walk(cls)}
    got = flags(subparser(name))
    assert set(got) == set(options)
    changes = getattr(cls, "CHANGES", {})
    for path, flag in got.items():
        f = options[path]
        assert flag == changes.get(path, {}).get("flag", flag_of(f))
        assert option_of(f).help, f"{path} has no help"
    if name == "train":
        # Each of TrainConfig's concerns, training's own and the rollout's it holds, is whole inside
        # the command (of the rollout's RolloutConfig, the options a training run takes; of the
        # sampling concern it holds in turn, the temperature).
        for held in fields(TrainConfig):
            spec = concern_of(held)
            names = spec.only or [f.name for f in fields(type(getattr(TrainConfig(), held.name)))]
            for n in names:
                inner = spec.changes.get(n)
                paths = [f"{n}.{m}" for m in inner.only] if isinstance(inner, Concern) else [n]
                assert {f"config.{held.name}.{p}" for p in paths} <= set(got), f"{held.name}.{n}"
        assert {p for p in got if ".sampling." in p} == {"config.rollout.sampling.temperature"}
        assert {f"config.{path}" for path in TrainConfig.PATHS.values()} == {p for p in got if p.startswith("config.")}
        return
    # The public configs are whole inside their commands: each of their fields is an option, and
    # each field of the sampling concern the rollout holds.
    assert {f"rollout.{f.name}" for f in fields(RolloutConfig) if f.name != "sampling"} <= set(got)
    assert {f"rollout.sampling.{f.name}" for f in fields(SamplingConfig)} == {p for p in got if ".sampling." in p}
    assert all(got[f"rollout.sampling.{f.name}"] == flag_of(f) for f in fields(SamplingConfig))


@pytest.mark.parametrize("name", COMMANDS)
def test_every_flag_is_under_its_fields_group_in_the_groups_order(name):
    """``--help`` lists each flag under its field's concern (the option's ``group`` or its
    config's ``GROUP``), the groups in :data:`HELP_GROUPS`'s order, none of 15 flags or more."""
    parser = subparser(name)
    declared = groups_of(COMMANDS[name])
    assert None not in declared.values()
    got = {a.dest: g.title for g in parser._action_groups for a in g._group_actions if a.dest != "help"}
    assert got == {path: HELP_GROUPS[group] for path, group in declared.items()}
    shown = [g.title for g in parser._action_groups if g.title in HELP_GROUPS.values()]
    assert shown == [t for t in HELP_GROUPS.values() if t in shown]
    assert max(len(g._group_actions) for g in parser._action_groups) < 15


@pytest.mark.parametrize(("name", "first"), [
    ("rollout", ["--env", "--model", "--tasks", "--group-size", "--out"]),
    ("eval", ["--env", "--model", "--tasks", "--k", "--out"]),
    ("train", ["--env", "--model", "--steps", "--groups-per-step", "--out-dir"])])
def test_the_usage_line_names_the_options_a_first_run_needs(name, first, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    usage = subparser(name).format_usage()
    assert usage.startswith(f"usage: agentenv {name} [{first[0]} ") and usage.rstrip().endswith("[options]")
    assert [w.strip("[") for w in usage.split() if w.startswith("[--")] == first
    assert len(usage.splitlines()) <= 2
    # In its group each of them comes before the rest: --env is the first flag --help lists.
    for group in subparser(name)._action_groups:
        listed = [a.option_strings[0] for a in group._group_actions if a.option_strings and a.dest != "help"]
        ours = [f for f in listed if f in first]
        assert listed[:len(ours)] == ours, group.title
    listed = [a.option_strings[0] for g in subparser(name)._action_groups for a in g._group_actions if a.dest != "help"]
    assert listed[0] == "--env"


def test_an_option_outside_every_group_is_refused_when_help_is_grouped():
    from dataclasses import dataclass

    @dataclass
    class Loose:
        grouped: int = option(1, "an option", group="rollout")
        stray: int = option(2, "another")

    with pytest.raises(ConfigError, match=r"Loose: options in groups \['None'\] that have no heading"):
        add_options(argparse.ArgumentParser(), Loose, groups=HELP_GROUPS)
    add_options(argparse.ArgumentParser(), Loose)  # ungrouped help takes it


def other_value(path: str, f, shape) -> tuple[list[str], object]:
    """Command-line tokens that set ``path`` to a value other than its default, and that value."""
    flag, default = flag_of(f), f.default
    special = {
        "env_kwargs": (["--env-arg", "extra_digits=3"], {"extra_digits": 3}),
        "eval_env_kwargs": (["--eval-env-arg", "extra_digits=2"], {"extra_digits": 2}),
        "engine_kwargs": (["--engine-arg", "page_size=32", "--engine-arg", "note=x"], {"page_size": 32, "note": "x"}),
        "env_modules": (["--env-module", "json"], ["json"]),
        "base_urls": (["--base-url", "http://a:1", "--base-url", "http://b:2"], ["http://a:1", "http://b:2"]),
        "env": (["--env", "agentenv.envs.retool_math:RetoolMathEnv"], "agentenv.envs.retool_math:RetoolMathEnv"),
        "judge": (["--judge", "http://127.0.0.1:1/v1"], "http://127.0.0.1:1/v1"),
        "device": (["--device", "cpu"], "cpu"),  # a device name is checked: auto, cpu, cuda or cuda:N
        # The limits below are the local sandbox's (--sandbox e2b with them is refused: below).
        "sandbox": (["--sandbox", "local"], "local"),
    }
    name = path.rsplit(".", 1)[-1]
    if name in special:
        return special[name]
    if shape.kind is bool:
        return [flag], not default
    if shape.choices:
        pick = next(c for c in shape.choices if c != default)
        return [flag, str(pick)], [pick] if shape.repeat else pick
    if shape.kind is int:
        value = 3 if default is None else default + 1
    elif shape.kind is float:
        value = 2.5 if default is None else (default / 2 if default else 0.5)
    elif shape.kind is Path:
        value = Path(f"{name}.other")
    else:
        value = f"{name}-other"
    return [flag, str(value)], value


@pytest.mark.parametrize("name", COMMANDS)
def test_every_flag_reaches_its_field(name):
    """Every option given a value other than its default on the command line: the configs
    built from the parse carry each of them."""
    cls = COMMANDS[name]
    argv, expected = [name], {}
    for path, f, shape in walk(cls):
        if path == "output.overwrite":  # excludes --resume: below
            continue
        tokens, value = other_value(path, f, shape)
        tokens[0] = getattr(cls, "CHANGES", {}).get(path, {}).get("flag", tokens[0])  # eval's --k
        argv += tokens
        expected[path] = value
    values = vars(build_parser(argv).parse_args(argv))
    values.pop("command")
    config = build(cls, values)
    for path, value in expected.items():
        got = config
        for part in path.split("."):
            got = getattr(got, part)
        assert got == value, path
    assert build(cls, {"output.overwrite": True}).output.overwrite is True
    with pytest.raises(ConfigError, match="--resume and --overwrite exclude each other"):
        build(cls, {"output.overwrite": True, **({"config.checkpoints.resume": True} if name == "train" else
                                                   {"output.resume": True})})


def test_train_help_shows_the_chosen_envs_training_defaults():
    defaults = describe("retool-math")["train_defaults"]
    helps = {a.dest: a.help for a in subparser("train")._actions}
    for key, value in defaults.items():
        if key == "env_kwargs":
            assert "retool-math's training defaults: extra_digits=1" in helps["config.env.env_kwargs"]
        else:
            assert f"default {value}" in helps[f"config.{TrainConfig.PATHS[key]}"], key
    # Another env: the trainer's own defaults.
    helps = {a.dest: a.help for a in subparser("train", ["train", "--env", "trace"])._actions}
    assert "(default 40)" in helps["config.optimiser.steps"] and "(default 2e-05)" in helps["config.optimiser.lr"]
    parsed = build_parser(["train", "--env", "trace"]).parse_args(["train", "--env", "trace"])
    assert vars(parsed)["config.optimiser.steps"] == TrainConfig().optimiser.steps


def test_a_check_names_the_option_and_the_value():
    with pytest.raises(ConfigError, match=r"^top_p must be > 0 and <= 1, got 2$"):
        RolloutConfig(top_p=2)
    with pytest.raises(ConfigError, match=r"^top_k must be >= 0, got -1$"):
        RolloutConfig(top_k=-1)
    with pytest.raises(ConfigError, match=r"^scheduling must be program, fifo or lockstep, got 'x'$"):
        RolloutConfig(scheduling="x")
    with pytest.raises(ConfigError, match=r"^temperature must be > 0, got 0$"):  # training divides by it
        TrainConfig(temperature=0)
    assert RolloutConfig(temperature=0).temperature == 0  # a rollout may sample greedily
    with pytest.raises(ConfigError, match=r"^max_staleness must be >= 0, got -1$"):
        TrainConfig(max_staleness=-1)


def test_train_config_is_its_concerns_and_takes_flat_names_unique_across_them():
    """TrainConfig holds the rollout's concerns (the same classes) and training's own; each option
    has a flat name no other concern's option has, which constructs and replaces it."""
    from agentenv.config import EnvOptions, JudgeOptions
    from agentenv.train.config import OptimiserOptions, TrainClusterOptions, TrainEngineOptions

    names = [f.name for _, f, _ in walk(TrainConfig)]
    assert len(names) == len(set(names)) == len(TrainConfig.PATHS)
    cfg = TrainConfig()
    assert (type(cfg.env), type(cfg.rollout), type(cfg.sandbox), type(cfg.judge)) == (
        EnvOptions, RolloutConfig, SandboxOptions, JudgeOptions)
    assert isinstance(cfg.engine, EngineOptions) and isinstance(cfg.engine, TrainEngineOptions)
    assert type(cfg.cluster) is TrainClusterOptions and type(cfg.cluster) is not ClusterOptions
    flat = TrainConfig(steps=2, lr=1e-3, env="trace", engine="embedded", out_dir="runs/x", temperature=0.7)
    assert (flat.optimiser.steps, flat.optimiser.lr, flat.env.env, flat.output.out_dir) == (2, 1e-3, "trace", "runs/x")
    assert flat.rollout.temperature == 0.7 and flat.rollout.max_new_tokens == RolloutConfig().max_new_tokens
    assert flat == TrainConfig(env=EnvOptions(env="trace"), optimiser=OptimiserOptions(steps=2, lr=1e-3),
                               out_dir="runs/x", temperature=0.7)
    assert flat.replace(lr=5e-4).optimiser == OptimiserOptions(steps=2, lr=5e-4)
    assert flat.settings()["lr"] == 1e-3 and set(flat.settings()) == set(names)
    with pytest.raises(ConfigError, match=r"^TrainConfig has no setting 'stepz' \(did you mean steps"):
        TrainConfig(stepz=3)
    with pytest.raises(ConfigError, match=r"no setting 'learning_rate' \(`agentenv train --help` lists them\)$"):
        TrainConfig(learning_rate=1e-3)
    with pytest.raises(ConfigError, match=r"no setting 'max_stalenes' \(did you mean max_staleness"):
        TrainConfig(max_stalenes=1)
    # An option given with its concern changes it: dataclasses.replace with a flat name works too.
    assert TrainConfig(optimiser=OptimiserOptions(steps=2), lr=1e-3).optimiser == OptimiserOptions(steps=2, lr=1e-3)
    assert dataclasses.replace(flat, lr=5e-4) == flat.replace(lr=5e-4)


def test_a_former_flat_read_of_train_config_still_reads_with_a_warning():
    import pickle

    cfg = TrainConfig(lr=1e-3, steps=3, engine="vllm", sandbox_pids=64)
    with pytest.warns(DeprecationWarning, match=r"TrainConfig.lr is deprecated: read cfg.optimiser.lr"):
        assert cfg.lr == 1e-3
    with pytest.warns(DeprecationWarning, match="cfg.optimiser.steps"):
        assert cfg.steps == 3
    with pytest.warns(DeprecationWarning, match=r"cfg.rollout.sampling.temperature$"):
        assert cfg.temperature == cfg.sampling.temperature
    with pytest.warns(DeprecationWarning, match=r"cfg.engine.engine_args\(\)"):
        assert cfg.engine_args() == cfg.engine.engine_args()
    with pytest.warns(DeprecationWarning, match="cfg.sandbox"):
        assert cfg.sandbox_options() is cfg.sandbox and cfg.sandbox.sandbox_pids == 64
    with pytest.raises(AttributeError, match="no attribute 'learning_rate'"):
        cfg.learning_rate  # noqa: B018
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # (Ray ships it to trainer ranks)
    # dataclasses.replace with a concern's name as an option's value would rebuild the rest of that
    # concern from its defaults (the model gone): refused, naming cfg.replace.
    with pytest.raises(ConfigError, match=r"write cfg.replace\(engine='vllm'\)"):
        dataclasses.replace(cfg, engine="vllm")
    assert dataclasses.replace(cfg, lr=5e-4).optimiser.lr == 5e-4
    assert cfg.replace(engine="embedded").engine.engine_kwargs == cfg.engine.engine_kwargs


def test_rollout_config_takes_and_reads_its_sampling_by_the_options_names():
    """``RolloutConfig(temperature=...)`` and ``cfg.temperature`` are the sampling concern it holds,
    given and read by the options' own names; the run configs and the trainer's read it as
    ``sampling`` and take the flat names too."""
    keywords = inspect.signature(RolloutConfig).parameters  # what help() and editors show
    assert keywords["temperature"].default == RolloutConfig().temperature and "sampling" in keywords
    cfg = RolloutConfig(temperature=0.7, top_p=0.9, max_turns=3)
    assert cfg.sampling == SamplingConfig(temperature=0.7, top_p=0.9)
    assert (cfg.temperature, cfg.top_p, cfg.top_k) == (0.7, 0.9, SamplingConfig().top_k) and cfg.max_turns == 3
    assert cfg == RolloutConfig(sampling=SamplingConfig(temperature=0.7, top_p=0.9), max_turns=3)
    # A name given over the concern given changes that option of it, the rest kept.
    assert RolloutConfig(sampling=SamplingConfig(top_k=5), temperature=0.2).sampling == SamplingConfig(0.2, 1.0, 5)
    assert dataclasses.replace(cfg, temperature=0.3).sampling == SamplingConfig(temperature=0.3, top_p=0.9)
    assert dataclasses.replace(cfg, max_turns=4).sampling == cfg.sampling
    assert dataclasses.replace(cfg, sampling=SamplingConfig(top_k=2)).temperature == SamplingConfig().temperature
    assert cfg.for_env(object()).sampling == cfg.sampling
    # The defaults are the engines', written there once.
    from agentenv.engines.base import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P

    assert (RolloutConfig().temperature, RolloutConfig().top_p, RolloutConfig().top_k) == (
        DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_TOP_K)
    assert RolloutRunConfig(rollout=cfg).sampling is cfg.sampling and EvalRunConfig().sampling == SamplingConfig()
    train = TrainConfig(temperature=0.5)
    assert train.sampling is train.rollout.sampling and train.rollout.temperature == 0.5
    assert TrainConfig(sampling=SamplingConfig(temperature=0.8)) == TrainConfig(temperature=0.8)
    assert train.replace(sampling=SamplingConfig(temperature=0.9)).settings()["temperature"] == 0.9
    assert dataclasses.replace(train, rollout=RolloutConfig(temperature=0.6)).sampling.temperature == 0.6
    # A concern given whole is as given: the env's training defaults (temperature 1.6) fill the rest.
    assert TrainConfig.for_env("retool-math").sampling.temperature == describe("retool-math")["train_defaults"][
        "temperature"]
    assert TrainConfig.for_env("retool-math", sampling=SamplingConfig(temperature=0.9)).sampling.temperature == 0.9
    # What a run's config.json and checkpoints store keeps its layout: the sampling among the rollout's options.
    saved = train.to_dict()
    assert (saved["rollout"]["temperature"], saved["rollout"]["top_p"]) == (0.5, SamplingConfig().top_p)
    assert "sampling" not in saved["rollout"] and set(saved) == {f.name for f in fields(TrainConfig)}


def test_train_config_refuses_what_training_cannot_do():
    with pytest.raises(ConfigError, match="GRPO needs group_size >= 2"):
        TrainConfig(group_size=1)
    with pytest.raises(ConfigError, match="leave the rollout's top_p and top_k off"):
        TrainConfig(rollout=RolloutConfig(top_p=0.9))
    with pytest.raises(ConfigError, match="trainer_ranks must be between 1 and the batch's 6"):
        TrainConfig(cluster="ray", trainer_ranks=7, groups_per_step=2, group_size=3)
    with pytest.raises(ConfigError, match="weight_sync='group' needs a vllm or openai engine"):
        TrainConfig(weight_sync="group")
    assert TrainConfig(engine="vllm", weight_sync="group").engine.engine_args() == {"weight_sync": "group"}


def test_resume_settings_are_the_fields_marked_resume():
    # Training's: by flat name, the held rollout options' marks as TrainConfig re-declares them
    # (a resumed run may change its sampling limits and its judge).
    assert set(TrainConfig.RESUME_KEYS) == {"env", "env_kwargs", "model", "groups_per_step", "group_size", "lora_rank",
                                            "seed"}
    assert TrainConfig.RESUME_KEYS == tuple(f.name for _, f, _ in walk(TrainConfig) if option_of(f).resume)
    opts = RolloutRunConfig()
    settings = resume_settings(opts, model="/m")
    assert set(settings) == {"env", "env_args", "tasks", "group_size", "seed", "model", "max_turns",
                             "max_new_tokens", "max_tokens_per_turn", "tool_timeout", "temperature", "top_p",
                             "top_k", "judge", "judge_weight", "judge_group"}
    assert settings["model"] == "/m" and settings["env_args"] == {} and settings["tasks"] == 32


def test_a_field_without_an_option_declaration_is_refused():
    from dataclasses import dataclass

    @dataclass
    class Loose:
        declared: int = option(1, "an option")
        bare: int = 2

    with pytest.raises(ConfigError, match="Loose.bare is not declared with option"):
        add_options(argparse.ArgumentParser(), Loose)


def parsed(cls: type, argv: list[str]):
    values = vars(build_parser(argv).parse_args(argv))
    values.pop("command")
    return build(cls, values)


def test_each_sandbox_limit_flag_is_a_field_of_the_sandboxs_limits():
    from dataclasses import fields as fields_of

    from agentenv.sandboxes.local.limits import Limits

    assert set(SANDBOX_LIMITS.values()) <= {f.name for f in fields_of(Limits)}
    own = {"sandbox", "sandbox_setup_timeout", "sandbox_unisolated"}
    assert set(SANDBOX_LIMITS) | own == {f.name for f in fields_of(SandboxOptions)}
    assert SandboxOptions().sandbox_kwargs() == {}  # none given: the sandbox's own defaults, stated in Limits only
    kwargs = SandboxOptions(sandbox_pids=9, sandbox_setup_timeout=4.0).sandbox_kwargs()
    assert kwargs == {"limits": Limits(pids=9), "setup_timeout": 4.0}


@pytest.mark.anyio
async def test_sandbox_limits_given_on_the_command_line_hold_in_a_session():
    """``rollout --sandbox-memory-mb 700 --sandbox-pids 40``: a session of the sandbox the run
    opens has that address space and process limit."""
    options = parsed(RolloutRunConfig, ["rollout", "--sandbox-memory-mb", "700", "--sandbox-pids", "40"]).sandbox
    async with open_sandbox(options) as sandbox:
        session = await sandbox.session()
        result = await session.run(
            "import resource as r\n(r.getrlimit(r.RLIMIT_AS)[0], r.getrlimit(r.RLIMIT_NPROC)[0])"
        )
        await session.aclose()
    assert result.value == repr((700 * 1024 * 1024, 40)), result


def test_train_takes_the_same_sandbox_limits():
    config = parsed(TrainRunConfig, ["train", "--sandbox-cpus", "0.5", "--sandbox-tmp-mb", "32"]).config
    assert config.sandbox == SandboxOptions(sandbox_cpus=0.5, sandbox_tmp_mb=32)


@pytest.mark.parametrize("name", ["rollout", "eval", "train"])
def test_sandbox_unisolated_lets_the_local_sandbox_run_with_what_the_host_has(name):
    built = parsed(COMMANDS[name], [name, "--sandbox-unisolated"])
    options = built.config.sandbox if name == "train" else built.sandbox
    assert options == SandboxOptions(sandbox_unisolated=True)
    assert open_sandbox(options).allow_unisolated is True
    assert open_sandbox(SandboxOptions()).allow_unisolated is False  # refusing is the default
    with pytest.raises(ConfigError, match="^--sandbox-unisolated is a setting of the local sandbox"):
        parsed(COMMANDS[name], [name, "--sandbox", "e2b", "--sandbox-unisolated"])


@pytest.mark.parametrize("name", ["rollout", "train"])
def test_a_sandbox_limit_with_e2b_is_refused_naming_the_flag(name):
    cls = COMMANDS[name]
    with pytest.raises(ConfigError, match="^--sandbox-pids is a setting of the local sandbox; --sandbox e2b"):
        parsed(cls, [name, "--sandbox", "e2b", "--sandbox-pids", "8"])
