"""The CLI's engine flags are EngineConfig's fields: every field is a flag or listed in
NOT_FLAGS with why, and each flag has its field's default, choices and help. No Ray, no
model: only the parser."""

import argparse
from dataclasses import MISSING, fields

import pytest

from deployments.cli import ENGINE_FLAGS, LORA_FLAGS, NOT_FLAGS, _engine_args, build_parser
from deployments.engine_flags import FIELDS, flag_name
from replica.config import EngineConfig

# The least each subcommand needs besides flags.
REQUIRED = {"generate": ["hi"], "serve": [], "batch": ["in.jsonl", "out.jsonl"]}


def subcommand_parser(command: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def flag_action(parser: argparse.ArgumentParser, name: str) -> argparse.Action:
    return next(a for a in parser._actions if flag_name(name) in a.option_strings)


def test_every_field_is_a_flag_or_says_why_not():
    as_flags = {name for names in ENGINE_FLAGS.values() for name in names}
    assert not as_flags & set(NOT_FLAGS)
    assert {f.name for f in fields(EngineConfig)} == as_flags | set(NOT_FLAGS)
    assert ENGINE_FLAGS.keys() == REQUIRED.keys()


@pytest.mark.parametrize("command", ENGINE_FLAGS)
def test_each_flag_has_its_fields_default_choices_and_help(command):
    parser = subcommand_parser(command)
    args = parser.parse_args(REQUIRED[command])
    for name in ENGINE_FLAGS[command]:
        field = FIELDS[name]
        assert field.default is not MISSING
        assert getattr(args, name) == field.default, name
        action = flag_action(parser, name)
        assert action.help, name
        choices = field.metadata.get("choices")
        if choices is None:
            assert action.choices is None, name
        else:
            assert list(action.choices) == [c for c in choices if c is not None], name
            for choice in choices:
                EngineConfig(**{name: choice})  # each one the config accepts


def test_flags_take_their_fields_types():
    parser = subcommand_parser("batch")
    argv = ["--tensor-parallel-size", "2", "--kv-cache-memory-gb", "0.5", "--enable-lora", "--max-loras", "3"]
    argv += ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    args = parser.parse_args([*REQUIRED["batch"], *argv])
    assert args.tensor_parallel_size == 2
    assert args.kv_cache_memory_gb == 0.5
    assert args.enable_lora is True and args.max_loras == 3
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(SystemExit):
        parser.parse_args([*REQUIRED["batch"], "--dtype", "int4"])


@pytest.mark.parametrize("command", ["generate", "batch"])
def test_engine_args_are_the_flags_values(command):
    """Without flags, the engine arguments make the default EngineConfig; LoRA's only
    with LoRA on."""
    args = subcommand_parser(command).parse_args(REQUIRED[command])
    args.command = command
    engine_args, modules = _engine_args(args)
    assert modules == {}
    assert set(engine_args) == set(ENGINE_FLAGS[command]) - set(LORA_FLAGS)
    assert EngineConfig.from_kwargs(**engine_args) == EngineConfig()


def test_serve_takes_the_generation_config_rule():
    """`--generation-config` reaches the app's config: "auto" by default, as in vLLM."""
    from deployments.cli import _serve_config

    assert _serve_config(build_parser().parse_args(["serve"])).generation_config == "auto"
    chosen = build_parser().parse_args(["serve", "--generation-config", "none"])
    assert _serve_config(chosen).generation_config == "none"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--generation-config", "vllm"])
