"""Tests for spin_batch.config: parsing, validation, overrides, round trip."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import yaml

from spin_batch.config import (
    DRAFTER_KINDS,
    SELECTOR_GRAMMAR,
    BatchConfig,
    ConfigError,
    EarlyExitDrafterConfig,
    JobConfig,
    ModelDrafterConfig,
    NgramDrafterConfig,
    SamplingConfig,
    SpinConfig,
    TargetConfig,
    apply_overrides,
    job_to_dict,
    load_job,
    parse_job,
)


def minimal() -> dict:
    """The smallest valid job."""
    return {"input": {"paths": "prompts.jsonl"}, "output": {"dir": "out"}}


def full() -> dict:
    """A job using every section and all three drafter kinds."""
    return {
        "name": "demo",
        "input": {
            "paths": ["data/*.jsonl", "more/"],
            "format": "jsonl",
            "id_column": "uid",
            "prompt_column": "text",
            "messages_column": "chat",
            "chat_template": False,
            "system_prompt": "Be brief.",
        },
        "output": {
            "dir": "out/demo",
            "rows_per_part": 100,
            "flush_interval_s": 5,
            "stats_interval_s": 2.5,
        },
        "target": {"model": "hf:some/model", "dtype": "bf16", "device": "cuda:1"},
        "drafters": [
            {"name": "ee4", "kind": "early_exit", "layers": 4},
            {"name": "small", "kind": "model", "model": "hf:tiny", "dtype": "fp16"},
            {"name": "ng", "kind": "ngram", "min_ngram": 2, "max_ngram": 5},
        ],
        "spin": {"selector": "fixed:small", "num_speculative_tokens": 6},
        "batch": {"slots": 4, "max_model_len": 2048, "max_num_batched_tokens": 256},
        "sampling": {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 50,
            "seed": 7,
            "max_tokens": 64,
            "stop": ["\n\n", "END"],
            "ignore_eos": True,
        },
    }


def problems(raw: dict, overrides: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Parse ``raw`` expecting failure; return the problem lines."""
    with pytest.raises(ConfigError) as info:
        parse_job(raw, overrides)
    assert str(info.value).startswith("invalid job <job>:")
    return info.value.problems


def single_problem(raw: dict, overrides: tuple[str, ...] = ()) -> str:
    """Parse ``raw`` expecting exactly one problem; return it."""
    found = problems(raw, overrides)
    assert len(found) == 1, found
    return found[0]


# ----------------------------------------------------------------- defaults


def test_minimal_job_gets_defaults():
    job = parse_job(minimal())
    assert job.name is None
    assert job.input.paths == ("prompts.jsonl",)
    assert job.input.format == "auto"
    assert job.input.chat_template == "auto"
    assert job.output.dir == "out"
    assert job.output.rows_per_part == 256
    assert job.target == TargetConfig()
    assert job.drafters == ()
    assert job.spin == SpinConfig(selector="none", num_speculative_tokens=4)
    assert job.spin.confidence_gate
    assert job.spin.backoff
    assert job.batch == BatchConfig()
    assert job.sampling == SamplingConfig()
    assert job.sampling.greedy


def test_auto_selector_is_the_bandit_when_drafters_exist():
    raw = minimal()
    raw["drafters"] = [
        {"name": "ng", "kind": "ngram"},
        {"name": "ee", "kind": "early_exit", "layers": 2},
    ]
    assert parse_job(raw).spin.selector == "ucb"


def test_explicit_none_selector_with_drafters():
    raw = minimal()
    raw["drafters"] = [{"name": "ng", "kind": "ngram"}]
    raw["spin"] = {"selector": "none"}
    assert parse_job(raw).spin.selector == "none"


# ----------------------------------------------------------------- full job


def test_full_job_with_all_drafter_kinds():
    job = parse_job(full())
    assert job.name == "demo"
    assert job.input.paths == ("data/*.jsonl", "more/")
    assert job.input.chat_template is False
    assert job.output.flush_interval_s == 5.0
    assert isinstance(job.output.flush_interval_s, float)
    assert job.target.dtype == "bfloat16"
    assert job.drafters == (
        EarlyExitDrafterConfig(name="ee4", layers=4),
        ModelDrafterConfig(name="small", model="hf:tiny", dtype="float16"),
        NgramDrafterConfig(name="ng", min_ngram=2, max_ngram=5),
    )
    assert job.drafter("small").kind == "model"
    assert job.spin.selector == "fixed:small"
    assert job.sampling.stop == ("\n\n", "END")
    assert not job.sampling.greedy


def test_drafter_lookup_unknown_name():
    with pytest.raises(KeyError, match="ee4"):
        parse_job(full()).drafter("nope")


def test_registry_and_selector_grammar():
    assert set(DRAFTER_KINDS) == {"early_exit", "model", "ngram", "vote", "cascade"}
    assert {"none", "fixed"} <= set(SELECTOR_GRAMMAR)


def test_model_drafter_dtype_defaults_to_target():
    raw = minimal()
    raw["drafters"] = [{"name": "m", "kind": "model", "model": "hf:tiny"}]
    assert parse_job(raw).drafters[0].dtype is None


# ----------------------------------------------------------------- unknown keys


def test_unknown_top_level_key_suggests():
    raw = minimal()
    raw["sampleing"] = {}
    assert single_problem(raw) == "sampleing: unknown key; did you mean 'sampling'?"


def test_unknown_section_key_suggests():
    raw = minimal()
    raw["batch"] = {"slot": 4}
    assert single_problem(raw) == "batch.slot: unknown key; did you mean 'slots'?"


def test_unknown_drafter_key_suggests():
    raw = minimal()
    raw["drafters"] = [
        {"name": "ng", "kind": "ngram"},
        {"name": "ee", "kind": "early_exit", "layers": 2, "layer": 3},
    ]
    assert single_problem(raw) == "drafters[1].layer: unknown key; did you mean 'layers'?"


def test_unknown_key_without_close_match_lists_valid_keys():
    raw = minimal()
    raw["batch"] = {"zzzzzz": 1}
    line = single_problem(raw)
    assert line.startswith("batch.zzzzzz: unknown key; valid keys: ")
    assert "'slots'" in line and "'max_model_len'" in line


def test_key_valid_for_other_drafter_kind_is_unknown():
    raw = minimal()
    raw["drafters"] = [{"name": "ng", "kind": "ngram", "layers": 2}]
    assert single_problem(raw).startswith("drafters[0].layers: unknown key")


def test_unknown_drafter_kind_lists_kinds():
    raw = minimal()
    raw["drafters"] = [{"name": "x", "kind": "medusa"}]
    line = single_problem(raw)
    assert line.startswith("drafters[0].kind: unknown drafter kind")
    assert "'early_exit', 'model', 'ngram'" in line


def test_missing_drafter_kind():
    raw = minimal()
    raw["drafters"] = [{"name": "x"}]
    assert single_problem(raw).startswith("drafters[0].kind: missing required key")


# ----------------------------------------------------------------- types


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("batch", "slots", True, "batch.slots: expected an integer, got bool True"),
        ("batch", "slots", "8", "batch.slots: expected an integer, got str '8'"),
        ("batch", "slots", "abc", "batch.slots: expected an integer, got str 'abc'"),
        ("batch", "slots", 2.0, "batch.slots: expected an integer, got float 2.0"),
        ("batch", "slots", None, "batch.slots: expected an integer, got null"),
        ("sampling", "temperature", False, "sampling.temperature: expected a number, got bool False"),
        ("sampling", "ignore_eos", 1, "sampling.ignore_eos: expected true or false, got int 1"),
        ("spin", "confidence_gate", "off", "spin.confidence_gate: expected true or false, got str 'off'"),
        ("spin", "backoff", "no", "spin.backoff: expected true or false, got str 'no'"),
        ("output", "dir", 3, "output.dir: expected a string, got int 3"),
    ],
)
def test_wrong_types(section, key, value, expected):
    raw = minimal()
    raw.setdefault(section, {})[key] = value
    assert single_problem(raw) == expected


def test_int_accepted_for_float():
    raw = minimal()
    raw["sampling"] = {"temperature": 1, "top_p": 1}
    sampling = parse_job(raw).sampling
    assert sampling.temperature == 1.0 and isinstance(sampling.temperature, float)


@pytest.mark.parametrize(
    ("section", "values", "path"),
    [
        ("batch", {"slots": 0}, "batch.slots"),
        ("batch", {"max_model_len": 8}, "batch.max_model_len"),
        ("batch", {"slots": 8, "max_num_batched_tokens": 4}, "batch.max_num_batched_tokens"),
        ("output", {"rows_per_part": 0}, "output.rows_per_part"),
        ("output", {"flush_interval_s": 0}, "output.flush_interval_s"),
        ("spin", {"num_speculative_tokens": 33}, "spin.num_speculative_tokens"),
        ("sampling", {"temperature": -0.1}, "sampling.temperature"),
        ("sampling", {"top_p": 0}, "sampling.top_p"),
        ("sampling", {"top_p": 1.5}, "sampling.top_p"),
        ("sampling", {"top_k": -2}, "sampling.top_k"),
        ("sampling", {"max_tokens": -1}, "sampling.max_tokens"),
        ("sampling", {"logprobs": 21}, "sampling.logprobs"),
        ("sampling", {"prompt_logprobs": -1}, "sampling.prompt_logprobs"),
        ("sampling", {"logprobs_mode": "processed_logits"}, "sampling.logprobs_mode"),
        ("sampling", {"max_tokens": 1024}, "sampling.max_tokens"),
        ("target", {"device": "gpu"}, "target.device"),
        ("target", {"model": ""}, "target.model"),
        ("input", {"paths": []}, "input.paths"),
        ("input", {"format": "csv"}, "input.format"),
        ("input", {"chat_template": "yes"}, "input.chat_template"),
    ],
)
def test_range_and_value_checks(section, values, path):
    raw = minimal()
    raw.setdefault(section, {}).update(values)
    assert single_problem(raw).startswith(f"{path}: ")


def test_batch_slots_message():
    raw = minimal()
    raw["batch"] = {"slots": 0}
    assert single_problem(raw) == "batch.slots: must be an integer >= 1, got 0"


@pytest.mark.parametrize("section", ["spin", "batch", "input"])
def test_null_or_non_mapping_section(section):
    raw = minimal()
    raw[section] = None
    assert single_problem(raw) == f"{section}: expected a mapping, got null"
    raw[section] = [1, 2]
    assert single_problem(raw).startswith(f"{section}: expected a mapping, got list")


def test_missing_required_sections():
    assert problems({}) == (
        "input: missing required section",
        "output: missing required section",
    )


def test_top_level_not_a_mapping():
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        parse_job(["not", "a", "mapping"])  # type: ignore[arg-type]


# ----------------------------------------------------------------- drafters / selector


def test_duplicate_drafter_names():
    raw = minimal()
    raw["drafters"] = [
        {"name": "d", "kind": "ngram"},
        {"name": "d", "kind": "early_exit", "layers": 2},
    ]
    assert single_problem(raw) == "drafters[1].name: duplicate drafter name 'd' (also drafters[0])"


@pytest.mark.parametrize("name", ["none", "bad name", "", "a/b"])
def test_bad_drafter_names(name):
    raw = minimal()
    raw["drafters"] = [{"name": name, "kind": "ngram"}]
    assert single_problem(raw).startswith("drafters[0].name: ")


def test_ngram_min_greater_than_max():
    raw = minimal()
    raw["drafters"] = [{"name": "ng", "kind": "ngram", "min_ngram": 4, "max_ngram": 2}]
    assert single_problem(raw).startswith("drafters[0].min_ngram: must be <= max_ngram")


def test_ngram_upper_bound():
    raw = minimal()
    raw["drafters"] = [{"name": "ng", "kind": "ngram", "max_ngram": 17}]
    assert single_problem(raw).startswith("drafters[0].max_ngram: must be an integer in [1, 16]")


def test_required_drafter_fields():
    raw = minimal()
    raw["drafters"] = [{"kind": "model"}, {"name": "e", "kind": "early_exit"}]
    assert problems(raw) == (
        "drafters[0].name: missing required key",
        "drafters[0].model: missing required key",
        "drafters[1].layers: missing required key (with quantize: int8 it defaults to all of the target's layers)",
    )


def test_fixed_selector_unknown_drafter_names_valid_ones():
    raw = minimal()
    raw["drafters"] = [{"name": "ng", "kind": "ngram"}, {"name": "ee", "kind": "early_exit", "layers": 1}]
    raw["spin"] = {"selector": "fixed:nope"}
    line = single_problem(raw)
    assert line.startswith("spin.selector: unknown drafter 'nope'")
    assert "'ng', 'ee'" in line


@pytest.mark.parametrize("selector", ["greedy", "ucb:x", "fixed", "fixed:", "none:x", ""])
def test_invalid_selectors(selector):
    raw = minimal()
    raw["drafters"] = [{"name": "ng", "kind": "ngram"}]
    raw["spin"] = {"selector": selector}
    assert single_problem(raw).startswith("spin.selector: ")


# ----------------------------------------------------------------- normalisation


@pytest.mark.parametrize(
    ("given", "canonical"),
    [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"), ("float16", "float16")],
)
def test_dtype_aliases(given, canonical):
    raw = minimal()
    raw["target"] = {"dtype": given}
    raw["drafters"] = [{"name": "m", "kind": "model", "model": "x", "dtype": given}]
    job = parse_job(raw)
    assert job.target.dtype == canonical
    assert job.drafters[0].dtype == canonical


def test_stop_as_string():
    raw = minimal()
    raw["sampling"] = {"stop": "###"}
    assert parse_job(raw).sampling.stop == ("###",)


def test_top_k_minus_one_normalised():
    raw = minimal()
    raw["sampling"] = {"top_k": -1}
    assert parse_job(raw).sampling.top_k == 0


# ----------------------------------------------------------------- overrides


def test_override_scalar_parsed_as_yaml():
    out = apply_overrides(minimal(), ["batch.slots=4", "sampling.ignore_eos=true", "name=null"])
    assert out["batch"]["slots"] == 4
    assert out["sampling"]["ignore_eos"] is True
    assert out["name"] is None


def test_override_nested_and_list_value():
    raw = minimal()
    out = apply_overrides(raw, ["input.paths=[a.jsonl, b.jsonl]", "output.dir=x=y"])
    assert out["input"]["paths"] == ["a.jsonl", "b.jsonl"]
    assert out["output"]["dir"] == "x=y"
    assert raw["input"]["paths"] == "prompts.jsonl"  # input untouched (deep copy)


def test_override_list_index():
    raw = full()
    job = parse_job(raw, ["drafters.0.layers=6", "spin.selector=fixed:ng"])
    assert job.drafters[0].layers == 6
    assert job.spin.selector == "fixed:ng"
    assert raw["drafters"][0]["layers"] == 4


def test_override_creates_missing_section():
    job = parse_job(minimal(), ["spin.num_speculative_tokens=8"])
    assert job.spin.num_speculative_tokens == 8


def test_override_replaces_null_section():
    raw = minimal()
    raw["batch"] = None
    assert parse_job(raw, ["batch.slots=2"]).batch.slots == 2


def test_override_missing_equals():
    with pytest.raises(ConfigError) as info:
        apply_overrides(minimal(), ["batch.slots"])
    assert info.value.problems == ("bad override 'batch.slots': expected KEY=VALUE",)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("drafters.3.layers=4", "index 3 out of range for 'drafters' (length 3)"),
        ("drafters.x.layers=4", "expected an index"),
        ("batch..slots=4", "empty component"),
        ("=4", "empty component"),
        ("target.model.x=1", "'target.model' is not a mapping or list"),
        ("batch.slots=[1", "invalid value"),
    ],
)
def test_bad_overrides(override, fragment):
    with pytest.raises(ConfigError) as info:
        apply_overrides(full(), [override])
    assert len(info.value.problems) == 1
    assert fragment in info.value.problems[0]


def test_override_index_into_missing_list():
    with pytest.raises(ConfigError, match="out of range for 'drafters' \\(length 0\\)"):
        apply_overrides(minimal(), ["drafters.0.layers=4"])


def test_bad_override_through_parse_job():
    with pytest.raises(ConfigError) as info:
        parse_job(minimal(), ["oops", "batch.slots=2"], source="j.yaml")
    assert str(info.value).startswith("invalid job j.yaml:")
    assert info.value.problems == ("bad override 'oops': expected KEY=VALUE",)


def test_override_value_is_validated():
    assert single_problem(minimal(), ("batch.slots=abc",)) == (
        "batch.slots: expected an integer, got str 'abc'"
    )


# ----------------------------------------------------------------- load_job


def test_load_job_from_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(full()), encoding="utf-8")
    job = load_job(path, ["batch.slots=2"])
    assert job == parse_job(full(), ["batch.slots=2"])
    assert load_job(str(path)).batch.slots == 4


def test_load_job_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml: file not found"):
        load_job(path)


def test_load_job_yaml_syntax_error(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("input:\n  paths: [a, b\noutput: {dir: x}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert str(info.value).startswith(f"invalid job {path}: YAML syntax error")
    assert "line" in str(info.value)


def test_load_job_empty_file_reports_missing_sections(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert str(info.value).startswith(f"invalid job {path}:")
    assert "input: missing required section" in info.value.problems


def test_load_job_validation_error_names_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("input: {paths: a}\noutput: {dir: o}\nbatch: {slots: 0}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"invalid job {path}:\n  batch.slots: "):
        load_job(path)


# ----------------------------------------------------------------- collection / round trip / frozen


def test_all_errors_collected():
    raw = minimal()
    raw["batch"] = {"slots": "8"}
    raw["sampling"] = {"top_p": 2}
    raw["target"] = {"dytpe": "bf16"}
    found = problems(raw)
    assert len(found) == 3
    assert [line.split(":")[0] for line in found] == [
        "target.dytpe",
        "batch.slots",
        "sampling.top_p",
    ]
    with pytest.raises(ConfigError) as info:
        parse_job(raw)
    assert str(info.value).count("\n") == 3


@pytest.mark.parametrize("make", [minimal, full])
def test_round_trip(make):
    job = parse_job(make())
    plain = job_to_dict(job)
    assert parse_job(plain) == job
    assert isinstance(plain["input"]["paths"], list)
    assert yaml.safe_load(yaml.safe_dump(plain)) == plain  # plain data only


def test_round_trip_drafters_include_kind():
    plain = job_to_dict(parse_job(full()))
    assert [d["kind"] for d in plain["drafters"]] == ["early_exit", "model", "ngram"]


def test_frozen():
    job = parse_job(full())
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.name = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.batch.slots = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.drafters[0].layers = 1  # type: ignore[misc]


def test_job_is_hashable_and_config_error_pickles():
    hash(parse_job(full()))
    err = ConfigError("invalid job x:", ["a: b"])
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err)
    assert isinstance(err, ValueError)


def test_direct_construction():
    job = JobConfig(
        input=parse_job(minimal()).input,
        output=parse_job(minimal()).output,
        drafters=(EarlyExitDrafterConfig(name="e", layers=2),),
    )
    assert job.drafter("e").kind == "early_exit"


@pytest.mark.parametrize("kind", ["vote", "cascade"])
def test_composite_drafter_members_are_checked(kind):
    raw = minimal()
    raw["drafters"] = [
        {"name": "ng", "kind": "ngram"},
        {"name": "e", "kind": "early_exit", "layers": 1},
        {"name": "c1", "kind": kind, "members": ["ng", "missing"]},
        {"name": "c2", "kind": kind, "members": ["ng", "c1"]},
        {"name": "c3", "kind": kind, "members": ["ng", "ng"]},
        {"name": "c4", "kind": kind, "members": ["ng"]},
        {"name": "c5", "kind": kind, "members": ["ng", "e", "ng"]},
    ]
    with pytest.raises(ConfigError) as e:
        parse_job(raw)
    msg = str(e.value)
    assert "drafters[2].members: unknown drafter 'missing'" in msg
    assert f"drafters[3].members: 'c1' is a {kind} drafter" in msg
    for i in (4, 5, 6):
        assert f"drafters[{i}].members: needs at least 2 distinct drafters" in msg
    assert "drafters[0]" not in msg and "drafters[1]" not in msg
    raw["drafters"] = raw["drafters"][:2] + [{"name": "c", "kind": kind, "members": ["ng", "e"]}]
    assert parse_job(raw).drafter("c").members == ("ng", "e")


def test_composite_drafter_settings_are_checked():
    raw = minimal()
    raw["drafters"] = [
        {"name": "ng", "kind": "ngram"}, {"name": "e", "kind": "early_exit", "layers": 1},
        {"name": "v", "kind": "vote", "members": ["ng", "e"], "beta": 1.5},
        {"name": "c", "kind": "cascade", "members": ["ng", "e"], "min_tokens": 0},
    ]
    with pytest.raises(ConfigError) as e:
        parse_job(raw)
    msg = str(e.value)
    assert "drafters[2].beta: must be a number in (0, 1)" in msg
    assert "drafters[3].min_tokens" in msg
    del raw["drafters"][2]["beta"], raw["drafters"][3]["min_tokens"]
    job = parse_job(raw)
    assert job.drafter("v").beta == 0.5 and job.drafter("c").min_tokens == 2


def test_pipeline_switch_takes_yaml_on_off_as_written():
    # YAML 1.1 reads a bare on/off as a bool: `--set spin.pipeline=on` and `pipeline: off` mean what they say
    assert parse_job(minimal(), ["spin.pipeline=on"]).spin.pipeline == "on"
    assert parse_job(minimal(), ["spin.pipeline=off"]).spin.pipeline == "off"
    raw = yaml.safe_load("input: {paths: p.jsonl}\noutput: {dir: out}\nspin: {pipeline: off}\n")
    assert parse_job(raw).spin.pipeline == "off"
    assert parse_job(minimal(), ["spin.pipeline=auto"]).spin.pipeline == "auto"
    with pytest.raises(ConfigError, match="spin.pipeline: must be one of 'auto', 'on', 'off', got int 1"):
        parse_job(minimal(), ["spin.pipeline=1"])


# ----------------------------------------------------------------- paths: ~ and $VAR


def test_paths_expand_home_and_environment_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DATA", "/data/set")
    monkeypatch.setenv("MODELS", "/models")
    raw = minimal()
    raw["input"]["paths"] = ["$DATA/a.jsonl", "${DATA}/b/*.jsonl", "~/c.jsonl", "/cost/$$5.jsonl"]
    raw["output"]["dir"] = "~/out/$DATA"
    raw["target"] = {"model": "$MODELS/target"}
    raw["drafters"] = [{"name": "small", "kind": "model", "model": "${MODELS}/small"}]
    job = parse_job(raw)
    assert job.input.paths == ("/data/set/a.jsonl", "/data/set/b/*.jsonl", f"{tmp_path}/home/c.jsonl",
                               "/cost/$5.jsonl")
    assert job.output.dir == f"{tmp_path}/home/out//data/set"
    assert job.target.model == "/models/target"
    assert job.drafter("small").model == "/models/small"
    assert parse_job(minimal()).target.model == "builtin:smollm2-135m"  # nothing to expand


def test_unset_environment_variable_in_a_path_is_a_job_error(monkeypatch):
    monkeypatch.delenv("SPIN_NOPE", raising=False)
    monkeypatch.setenv("SPIN_EMPTY", "")
    raw = minimal()
    raw["input"]["paths"] = ["ok.jsonl", "$SPIN_NOPE/a.jsonl"]
    raw["output"]["dir"] = "${SPIN_EMPTY}/out"
    raw["target"] = {"model": "$SPIN_NOPE/m"}
    with pytest.raises(ConfigError) as info:
        parse_job(raw)
    problems = info.value.problems
    assert "input.paths: environment variable $SPIN_NOPE is not set (or empty) in '$SPIN_NOPE/a.jsonl'" in problems
    assert any(p.startswith("output.dir: environment variable $SPIN_EMPTY is not set") for p in problems), problems
    assert any(p.startswith("target.model: environment variable $SPIN_NOPE") for p in problems), problems


def test_max_line_bytes():
    assert parse_job(minimal()).input.max_line_bytes == 64 * 1024 * 1024
    raw = minimal()
    raw["input"]["max_line_bytes"] = 0
    with pytest.raises(ConfigError, match="input.max_line_bytes: must be an integer >= 1"):
        parse_job(raw)


def test_early_exit_layers_default_to_all_only_for_an_int8_copy():
    raw = minimal()
    raw["drafters"] = [{"name": "q8", "kind": "early_exit", "quantize": "int8"},
                       {"name": "q8-12", "kind": "early_exit", "quantize": "int8", "layers": 12}]
    q8, q8_12 = parse_job(raw).drafters
    assert (q8.layers, q8.quantize, q8_12.layers) == (None, "int8", 12)
    raw["drafters"] = [{"name": "ee", "kind": "early_exit"}]
    assert single_problem(raw).startswith("drafters[0].layers: missing required key (with quantize: int8")
    raw["drafters"] = [{"name": "ee", "kind": "early_exit", "layers": 2, "quantize": "int4"}]
    assert single_problem(raw).startswith("drafters[0].quantize: ")


def test_early_exit_lookahead_defaults_and_bounds():
    raw = minimal()
    raw["drafters"] = [{"name": "q8", "kind": "early_exit", "quantize": "int8"},
                       {"name": "q8-off", "kind": "early_exit", "quantize": "int8", "lookahead": 0}]
    q8, off = parse_job(raw).drafters
    assert (q8.lookahead, off.lookahead) == (3, 0)
    for bad in (-1, 9, "3", True):
        raw["drafters"] = [{"name": "q8", "kind": "early_exit", "quantize": "int8", "lookahead": bad}]
        assert single_problem(raw).startswith("drafters[0].lookahead: ")
