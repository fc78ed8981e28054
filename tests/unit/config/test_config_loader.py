"""load_config: one clear line per problem naming the dotted key; overrides; dump_config round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharpen.config import ConfigError, SharpenConfig, dump_config, load_config
from sharpen.config.advantages import GRPOAdvantage
from sharpen.config.engines import ScriptedEngineConfig
from sharpen.config.loader import parse_override
from sharpen.config.policy_losses import GSPOLoss
from sharpen.config.schema import JsonlDataConfig
from sharpen.config.section import DeprecatedKeyWarning


def _error(path: str | Path | None, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message, f"expected one line, got: {message!r}"
    assert "Traceback" not in message
    return message


def test_defaults_load_without_a_recipe():
    assert load_config(None) == SharpenConfig()


def test_unknown_key_names_the_dotted_key_and_suggests_the_field():
    message = _error(None, ["trainer.learning_rat=1e-5"])
    assert message == "trainer.learning_rat: unknown key (did you mean 'learning_rate'?)"
    message = _error(None, ["trainer.algorithm.policy_loss.clip_eps_hi=0.3"])
    assert message == "trainer.algorithm.policy_loss.clip_eps_hi: unknown key (did you mean 'clip_eps_high'?)"
    message = _error(None, ["trainer.algorithm.clip_eps_hi=0.3"])  # a flat key of earlier recipes, misspelt
    assert message == "trainer.algorithm.clip_eps_hi: unknown key (did you mean 'policy_loss.clip_eps_high'?)"
    message = _error(None, ["trainer.algorithm.kl.coef=0.1"])  # the KL section's default type is "none"
    assert message == "trainer.algorithm.kl.coef: unknown key (it belongs to type = 'loss' or 'reward')"


def test_unknown_section_in_a_recipe(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[traner]\nlearning_rate = 1e-5\n")
    assert _error(recipe, []) == "traner: unknown key (did you mean 'trainer'?)"
    assert _error(None, ["telemetry.on=true"]) == "telemetry: unknown key"


def test_micro_batch_size_must_divide_the_rollouts_per_step():
    message = _error(
        None, ["trainer.micro_batch_size=4", "rollout.prompts_per_step=5", "rollout.num_samples_per_prompt=3"]
    )
    assert message.startswith("trainer.micro_batch_size = 4 does not divide")
    assert "rollout.prompts_per_step 5" in message and "rollout.num_samples_per_prompt 3" in message
    assert "= 15" in message
    ok = load_config(
        None, ["trainer.micro_batch_size=5", "rollout.prompts_per_step=5", "rollout.num_samples_per_prompt=3"]
    )
    assert ok.num_rollouts_per_step == 15


def test_wrong_type_and_out_of_range_name_the_key_and_the_value():
    message = _error(None, ["trainer.learning_rate=fast"])
    assert message.startswith("trainer.learning_rate: ") and '"fast"' in message
    message = _error(None, ["run.num_steps=0"])
    assert message.startswith("run.num_steps: ") and "greater than or equal to 1" in message and "got 0" in message
    message = _error(None, ["model.dtype=float16"])
    assert message.startswith("model.dtype: ") and "float16" in message


def test_missing_recipe_and_invalid_toml(tmp_path):
    missing = tmp_path / "nope.toml"
    assert _error(missing, []) == f"recipe {str(missing)!r} does not exist"
    broken = tmp_path / "broken.toml"
    broken.write_text("[run]\nname = \n")
    message = _error(broken, [])
    assert message.startswith(f"recipe {str(broken)!r} is not valid TOML: ")
    assert "line 2" in message


def test_malformed_override_and_override_through_a_value():
    assert "expected KEY=VALUE" in _error(None, ["trainer"])
    assert "'name' is a value, not a section" in _error(None, ["run.name=x", "run.name.deeper=1"])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("trainer.learning_rate=1e-5", (["trainer", "learning_rate"], 1e-5)),
        ("run.num_steps=3", (["run", "num_steps"], 3)),
        ("monitoring.progress=false", (["monitoring", "progress"], False)),
        ("trainer.betas=[0.8, 0.9]", (["trainer", "betas"], [0.8, 0.9])),
        ("run.name=my-run", (["run", "name"], "my-run")),  # not TOML: kept as the string
        ('run.name="42"', (["run", "name"], "42")),  # quoted TOML string
        ("weight_sync.probe_text=a = b", (["weight_sync", "probe_text"], "a = b")),  # split at the first '='
        ("run.name=", (["run", "name"], "")),
    ],
)
def test_override_values_are_toml_else_strings(text, expected):
    assert parse_override(text) == expected


def test_dotted_overrides_reach_nested_values_and_beat_the_recipe(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[run]\nname = "from-recipe"\nnum_steps = 7\n[trainer.algorithm]\npolicy_loss = "gspo"\n'
        "[trainer.algorithm.advantage]\nstd = 'population'\n"
    )
    config = load_config(
        recipe,
        [
            "run.name=from-cli",
            "trainer.algorithm.policy_loss.clip_eps_low=0.1",  # tunes the section the recipe named
            "trainer.algorithm.entropy_coef=0.01",
            "trainer.betas=[0.8, 0.95]",
            "rollout.engine.type=scripted",
            'rollout.engine.completions=["a", "b"]',
            "data.type=jsonl",
            "data.path=tasks.jsonl",
        ],
    )
    assert config.run.name == "from-cli"
    assert config.run.num_steps == 7
    assert config.trainer.algorithm.policy_loss == GSPOLoss(clip_eps_low=0.1, clip_eps_high=4e-4)
    assert config.trainer.algorithm.advantage == GRPOAdvantage(std="population")
    assert config.trainer.algorithm.entropy_coef == 0.01
    assert config.trainer.betas == (0.8, 0.95)
    assert config.rollout.engine == ScriptedEngineConfig(completions=["a", "b"])
    assert config.data == JsonlDataConfig(path="tasks.jsonl")


def test_dump_config_round_trips(tmp_path):
    config = load_config(
        None,
        [
            "run.name=round-trip",
            "trainer.learning_rate=3e-6",
            "trainer.betas=[0.8, 0.95]",
            "rollout.engine.type=scripted",
            'rollout.engine.completions=["<answer>1</answer>", "x"]',
            "data.task_config={min_terms = 2, max_terms = 3}",
            'data.system_prompt=""',
        ],
    )
    dumped = tmp_path / "config.toml"
    dumped.write_text(dump_config(config))
    assert load_config(dumped) == config
    jsonl = load_config(None, ["data.type=jsonl", "data.path=x.jsonl"])  # system_prompt None is left out
    dumped.write_text(dump_config(jsonl))
    assert load_config(dumped) == jsonl
    assert "system_prompt" not in dumped.read_text()


def test_a_typed_section_without_type_means_its_default_implementation(tmp_path):
    config = load_config(None, ["data.task=chain_sum", "rollout.engine.gpu_memory_utilization=0.5"])
    assert config.data.type == "reasoning_gym" and config.data.task == "chain_sum"
    assert config.rollout.engine.type == "vllm" and config.rollout.engine.gpu_memory_utilization == 0.5
    recipe = tmp_path / "r.toml"
    recipe.write_text("[data]\nsize = 10\n")
    assert load_config(recipe).data.size == 10
    message = _error(None, ["data.type=csv"])
    assert message.startswith("data: ") and "'reasoning_gym', 'jsonl'" in message


def test_the_evaluation_recipes_are_valid():
    from pathlib import Path

    recipes = sorted((Path(__file__).parents[3] / "recipes" / "eval").glob("*.toml"))
    assert recipes
    for recipe in recipes:
        config = load_config(recipe, [])
        assert config.evaluation.num_samples >= max(config.evaluation.ks)


def test_async_settings_need_async_mode_and_load_in_it():
    with pytest.raises(ConfigError, match=r'rollout\.weight_updates = "in_flight" needs rollout\.mode = "async"'):
        load_config(None, ['rollout.weight_updates="in_flight"'])
    config = load_config(None, ['rollout.mode="async"', "rollout.max_staleness=3", 'rollout.weight_updates="abort"'])
    assert (config.rollout.max_staleness, config.rollout.weight_updates) == (3, "abort")
    with pytest.raises(ConfigError, match=r"rollout\.max_staleness"):
        load_config(None, ['rollout.mode="async"', "rollout.max_staleness=-1"])


def test_the_replica_timeout_of_failover_must_be_below_the_request_timeout():
    config = load_config(None, ["rollout.num_engines=2", "rollout.failover.replica_timeout_s=30"])
    assert config.rollout.failover.replica_timeout_s == 30 and config.rollout.failover.restart
    message = r"rollout\.failover\.replica_timeout_s = 600 must be below rollout\.request_timeout_s = 600"
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["rollout.failover.replica_timeout_s=600"])
    longer = load_config(None, ["rollout.request_timeout_s=1200", "rollout.failover.replica_timeout_s=900"])
    assert longer.rollout.failover.replica_timeout_s == 900


def test_a_sharded_trainer_refuses_a_critic():
    with pytest.raises(ConfigError, match='trainer_ranks = 2 shards the policy with FSDP2, but advantage = "gae"'):
        load_config(None, ['runtime.type="ray"', "runtime.trainer_ranks=2", 'trainer.algorithm.advantage="gae"'])


def test_trainer_ranks_need_a_multiple_of_the_parallel_layout():
    """The layout's ranks per data shard (tp x dp_replicate x pp x cp) must divide the trainer ranks (Ray actors, or
    the embedded runtime's local processes); one line."""
    assert load_config(None, ["runtime.trainer_ranks=2"]).runtime.type == "embedded"  # local rank processes
    ray = ['runtime.type="ray"', "runtime.trainer_ranks=2"]
    message = r"trainer\.parallel spans 4 ranks per data shard \(tp 2 x dp_replicate 1 x pp 1 x cp 2\), which does not"
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*ray, "trainer.parallel.tp=2", "trainer.parallel.cp=2"])
    config = load_config(None, [*ray, "trainer.parallel.tp=2"])
    assert config.trainer.parallel.ranks_per_shard == 2 and config.trainer.parallel.sequence_parallel


def test_colocation_refuses_async_mode_unpaired_engines_and_more_than_one_gpu_per_pair():
    with pytest.raises(ConfigError, match=r'runtime\.colocate puts the engine to sleep .* rollout\.mode = "async"'):
        load_config(None, ["runtime.colocate=true", 'rollout.mode="async"'])
    ray = ['runtime.type="ray"', "runtime.colocate=true"]
    with pytest.raises(ConfigError, match=r"rollout\.num_engines = 1 must equal runtime\.trainer_ranks = 2"):
        load_config(None, [*ray, "runtime.trainer_ranks=2"])
    with pytest.raises(ConfigError, match=r"trainer_gpus = 1 and engine_gpus = 0\.5 add up to more than 1"):
        load_config(None, [*ray, "runtime.trainer_gpus=1", "runtime.engine_gpus=0.5"])
    config = load_config(None, [*ray, "runtime.trainer_ranks=2", "rollout.num_engines=2", "runtime.engine_gpus=0.5"])
    assert config.runtime.colocate and config.rollout.num_engines == 2
    local = load_config(None, ["runtime.colocate=true", "rollout.num_engines=3"])  # one process: nothing to pair
    assert local.rollout.num_engines == 3


def test_a_runtime_given_beside_the_recipe_replaces_its_section_and_is_validated_with_it():
    from sharpen.config.runtime import RuntimeConfig
    from sharpen.orchestration.runtime import with_runtime

    config = load_config(None, ["rollout.prompts_per_step=6"])
    merged = with_runtime(config, RuntimeConfig(type="ray", colocate=True))
    assert (merged.runtime.type, merged.runtime.colocate, merged.rollout.prompts_per_step) == ("ray", True, 6)
    with pytest.raises(ConfigError, match=r'runtime\.colocate puts the engine to sleep .* rollout\.mode = "async"'):
        with_runtime(load_config(None, ['rollout.mode="async"']), RuntimeConfig(colocate=True))


def test_the_broadcast_backend_is_nccl_only_between_gpus_that_are_not_shared():
    ray = ['runtime.type="ray"', 'weight_sync.transport="broadcast"']
    assert load_config(None, ray).broadcast_backend == "gloo"
    gpus = [*ray, "runtime.trainer_gpus=1", "runtime.engine_gpus=1"]
    assert load_config(None, gpus).broadcast_backend == "nccl"
    assert load_config(None, [*gpus, 'weight_sync.broadcast_backend="gloo"']).broadcast_backend == "gloo"
    shared = [*ray, "runtime.colocate=true", "runtime.trainer_gpus=0.5", "runtime.engine_gpus=0.5"]
    assert load_config(None, shared).broadcast_backend == "gloo"
    with pytest.raises(ConfigError, match=r'broadcast_backend = "nccl" cannot join a trainer rank and an engine'):
        load_config(None, [*shared, 'weight_sync.broadcast_backend="nccl"'])
    with pytest.raises(ConfigError, match=r'broadcast_backend = "nccl" needs GPUs on both ends'):
        load_config(None, [*ray, 'weight_sync.broadcast_backend="nccl"'])


def test_a_tensor_parallel_engine_actor_needs_a_gpu_per_worker():
    ray = ['runtime.type="ray"', "rollout.engine.tensor_parallel_size=2"]
    with pytest.raises(ConfigError, match=r"tensor_parallel_size = 2 puts one vLLM worker on each of 2 GPUs"):
        load_config(None, [*ray, "runtime.engine_gpus=1"])
    assert load_config(None, [*ray, "runtime.engine_gpus=2"]).rollout.engine.tensor_parallel_size == 2
    assert load_config(None, ray).runtime.engine_gpus == 0  # CPU actors: the workers bind cores instead


def test_renamed_keys_still_load_with_one_deprecation_line_each():
    with pytest.warns(DeprecatedKeyWarning) as caught:
        config = load_config(None, ['data={type = "hf", path = "d.parquet", prompt_column = "q", answer_column = "a"}'])
    assert (config.data.prompt_field, config.data.answer_field) == ("q", "a")  # type: ignore[union-attr]
    assert sorted(str(w.message) for w in caught) == [
        "data.answer_column is now called answer_field: write answer_field",
        "data.prompt_column is now called prompt_field: write prompt_field",
    ]
    message = _error(None, ['data={type = "hf", path = "d.parquet", prompt_column = "q", prompt_field = "p"}'])
    assert message == "data: prompt_column is the old name of prompt_field: give only prompt_field"
    with pytest.warns(DeprecatedKeyWarning, match='runtime.type = "local" is now called "embedded"'):
        assert load_config(None, ['runtime.type="local"']).runtime.type == "embedded"
    with pytest.warns(DeprecatedKeyWarning, match="runtime.num_cpus is now called ray_cpus"):
        assert load_config(None, ["runtime.num_cpus=2"]).runtime.ray_cpus == 2
    with pytest.warns(DeprecatedKeyWarning, match="rollout.engine.startup_timeout_s is now called start_timeout_s"):
        engine = load_config(None, ['rollout.engine={type = "vllm_server", startup_timeout_s = 60}']).rollout.engine
    assert engine.start_timeout_s == 60  # type: ignore[union-attr]


def test_the_direct_weight_sync_needs_the_object_store_and_no_lora():
    config = load_config(None, ["runtime.trainer_ranks=2", 'weight_sync.assemble="receiver"'])
    assert config.weight_sync.assemble == "receiver"
    ray = ['runtime.type="ray"', 'weight_sync.transport="broadcast"', 'weight_sync.assemble="receiver"']
    with pytest.raises(
        ConfigError, match=r'assemble = "receiver" sends each trainer rank\'s pieces through the object'
    ):
        load_config(None, ray)
    with pytest.raises(ConfigError, match=r'assemble = "receiver" assembles the base weights, not LoRA\'s'):
        load_config(None, ['weight_sync.assemble="receiver"', "trainer.lora.enabled=true"])
