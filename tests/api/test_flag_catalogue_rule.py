"""Issue 19's rule, "nothing silent", enforced.

1. Every ``implemented`` flag of the catalogue (tokenloom/api/flags.py) sets a config field that
   code outside the config/flag modules reads (a static check over the package's source), and
   a behavioural test shows its effect: :data:`BEHAVIOUR_TESTS` maps each implemented flag to
   that test, and this module checks the test exists.
2. Every field the request models declare (protocol, responses, messages, pooling) is read by
   the serving code, or listed in :data:`UNREAD_REQUEST_FIELDS` with what happens to it.

To add a flag: give it its catalogue entry, read its field where it acts, write the test that
shows the effect, and add one line to BEHAVIOUR_TESTS: ``"--flag": "tests/path.py::test_name"``
(``Class::test_name`` for a method). A flag whose field nothing reads fails
test_every_implemented_flag_is_read_outside_the_config_modules: implement it or make it
``unimplemented`` (refused by name) or a warned ``noop``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib

import pytest

from tokenloom.api import flags
from tokenloom.api.flags import CLI, ENGINE, FLAGS, IMPLEMENTED, SERVER, Flag
from tokenloom.core import config as engine_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tokenloom"
# where a flag is parsed, routed, defaulted and validated: a read there is not a use
CONFIG_MODULES = frozenset(
    {"api/flags.py", "api/serve_args.py", "api/server_config.py", "api/serve_help.py"}
    | {f"core/config/{path.name}" for path in (PACKAGE / "core" / "config").glob("*.py")}
)

# flag -> the test that shows what it does (path relative to the checkout :: test name)
BEHAVIOUR_TESTS: dict[str, str] = {
    # -- cluster interfaces (issue 38)
    "--otlp-traces-endpoint": "tests/e2e/test_tracing_scripted.py::test_a_request_with_a_traceparent_is_a_child_span_with_its_counts",
    "--collect-detailed-traces": "tests/api/test_tracing.py::test_detailed_traces_need_an_endpoint_and_known_modules",
    "--headless": "tests/core/engine/test_multinode_data_parallel.py::test_a_headless_nodes_replica_serves_with_the_heads_and_its_loss_fails_only_its_streams",
    "--data-parallel-address": "tests/core/engine/test_multinode_data_parallel.py::test_a_headless_nodes_replica_serves_with_the_heads_and_its_loss_fails_only_its_streams",
    "--data-parallel-rpc-port": "tests/core/engine/test_multinode_data_parallel.py::test_a_headless_nodes_replica_serves_with_the_heads_and_its_loss_fails_only_its_streams",
    "--data-parallel-start-rank": "tests/core/engine/test_multinode_data_parallel.py::test_a_hybrid_node_balances_over_its_own_replicas_only",
    "--data-parallel-rank": "tests/core/engine/test_multinode_data_parallel.py::test_a_rank_given_is_one_replica_behind_an_external_load_balancer",
    "--data-parallel-hybrid-lb": "tests/core/engine/test_multinode_data_parallel.py::test_a_hybrid_node_balances_over_its_own_replicas_only",
    "--nnodes": "tests/builtin_plugins/executors/test_worker_nodes.py::test_workers_on_two_nodes_give_the_single_process_greedy_ids",
    "--node-rank": "tests/builtin_plugins/executors/test_worker_nodes.py::test_workers_on_two_nodes_give_the_single_process_greedy_ids",
    "--master-addr": "tests/builtin_plugins/executors/test_worker_nodes.py::test_workers_on_two_nodes_give_the_single_process_greedy_ids",
    "--master-port": "tests/builtin_plugins/executors/test_worker_nodes.py::test_workers_on_two_nodes_give_the_single_process_greedy_ids",
    # -- images in (issue 35)
    "--limit-mm-per-prompt": "tests/api/test_multimodal_inputs.py::test_limits_come_from_the_flag_within_the_models_maximum",
    "--mm-processor-kwargs": "tests/api/test_multimodal_inputs.py::test_request_processor_kwargs_update_the_servers",
    "--mmproj": "tests/builtin_plugins/loaders/test_gguf_mmproj.py::test_gguf_with_its_mmproj_gives_the_safetensors_tokens",
    "--enable-mm-embeds": "tests/api/test_multimodal_inputs.py::test_image_embeds_parts_need_the_flag_and_a_model_that_takes_them",
    "--allowed-local-media-path": "tests/e2e/test_vision_server.py::test_a_file_url_under_the_allowed_path_is_read",
    "--allowed-media-domains": "tests/api/test_media.py::test_http_urls_only_from_the_allowed_domains",
    "--logits-processors": "tests/core/test_logits_processors.py::test_engine_logits_processors_apply_to_every_request_and_request_ones_offline",
    "--logits-processor-pattern": "tests/e2e/test_requests_smollm2.py::test_a_qualified_logits_processor_allowed_by_the_pattern_runs_on_the_request",
    "--calculate-kv-scales": "tests/core/test_model_runner_kv_cache.py::test_calculate_kv_scales_sets_each_layers_scales_from_the_first_step",
    # -- speculative decoding (issue 23)
    "--speculative-config": "tests/e2e/test_spec_decode_smollm2.py::test_single_stream_greedy_ids_are_identical",
    "--speculative-model": "tests/api/test_serve_args.py::test_older_draft_model_flags_map_onto_the_config",
    "--num-speculative-tokens": "tests/api/test_serve_args.py::test_older_speculative_flags_map_onto_the_config",
    "--ngram-prompt-lookup-min": "tests/api/test_serve_args.py::test_older_speculative_flags_map_onto_the_config",
    "--ngram-prompt-lookup-max": "tests/api/test_serve_args.py::test_older_speculative_flags_map_onto_the_config",
    "--speculative-disable-by-batch-size": "tests/core/spec_decode/test_spec_decode_engine.py::test_no_speculation_above_disable_by_batch_size",
    "--spec-decoding-acceptance-method": "tests/api/test_serve_args.py::test_bad_speculative_configs_say_what_to_change",
    "--speculative-model-quantization": "tests/core/spec_decode/test_spec_decode_draft_model.py::test_the_draft_quantization_is_the_drafts_own",
    "--speculative-max-model-len": "tests/core/spec_decode/test_spec_decode_draft_model.py::test_draft_max_model_len_bounds_the_positions_drafted",
    "--speculative-draft-tensor-parallel-size": "tests/api/test_serve_args.py::test_bad_speculative_configs_say_what_to_change",
    "--kv-events-config": "tests/e2e/test_kv_events_smollm2.py::test_events_follow_the_prefix_cache_through_evictions_and_a_reset",
    "--kv-transfer-config": "tests/e2e/test_kv_connector_restart.py::test_a_restarted_server_takes_the_prefix_from_the_directory",
    # -- data parallelism (issue 21)
    "--data-parallel-size": "tests/core/engine/test_data_parallel.py::test_two_replica_processes_serve_as_one_engine_and_a_killed_one_fails_only_its_streams",
    "--data-parallel-size-local": "tests/core/engine/test_data_parallel.py::test_ray_replicas_beyond_the_local_count_go_to_other_nodes",
    "--data-parallel-backend": "tests/e2e/test_data_parallel_ray_smollm2.py::test_concurrent_requests_use_both_replicas_and_metrics_sum_them",
    # -- LoRA (issue 22) and the attention backend (issue 25)
    "--enable-lora": "tests/e2e/test_lora_server.py::test_static_adapter_is_listed_with_its_parent_and_used_by_name",
    "--lora-modules": "tests/api/test_serving_models.py::test_adapters_are_listed_and_picked_by_model",
    "--max-loras": "tests/lora/test_lora_llm.py::test_adapter_slots_follow_lru",
    "--max-cpu-loras": "tests/lora/test_lora_llm.py::test_adapter_slots_follow_lru",
    "--max-lora-rank": "tests/lora/test_lora_llm.py::test_rank_above_max_lora_rank_is_refused",
    "--lora-dtype": "tests/lora/test_lora_llm.py::test_lora_dtype_sets_the_adapter_weights_dtype",
    "--attention-backend": "tests/e2e/test_triton_backend.py::test_greedy_completions_over_http_equal_the_torch_backends",
    # -- the command line itself
    "--config": "tests/api/test_serve_args.py::test_config_file_precedence_command_line_over_file_over_defaults",
    "--structured-outputs-config": "tests/api/test_serve_args.py::test_old_and_new_names_of_the_same_setting",
    # -- Frontend
    "--host": "tests/api/test_app.py::test_uvicorn_gets_the_server_options",
    "--port": "tests/api/test_server.py::test_run_server_serves_until_told_to_exit",
    "--uvicorn-log-level": "tests/api/test_app.py::test_uvicorn_gets_the_server_options",
    "--disable-uvicorn-access-log": (
        "tests/api/test_flag_effects.py::test_uvicorn_gets_the_client_certificate_options_and_the_access_log_switch"
    ),
    "--api-key": "tests/api/test_middleware.py::test_api_key_is_required_except_on_public_routes",
    "--metrics-require-key": "tests/api/test_middleware.py::test_metrics_can_require_the_key",
    "--allow-credentials": "tests/api/test_flag_effects.py::test_cors_credentials_methods_and_headers_are_the_configured_ones",
    "--allowed-origins": "tests/api/test_middleware.py::test_cors_headers_and_preflight",
    "--allowed-methods": "tests/api/test_flag_effects.py::test_cors_credentials_methods_and_headers_are_the_configured_ones",
    "--allowed-headers": "tests/api/test_flag_effects.py::test_cors_credentials_methods_and_headers_are_the_configured_ones",
    "--middleware": "tests/api/test_middleware.py::test_custom_middleware_function_and_class",
    "--root-path": "tests/api/test_app.py::test_root_path_behind_a_proxy",
    "--ssl-keyfile": "tests/api/test_app.py::test_uvicorn_gets_the_server_options",
    "--ssl-certfile": "tests/api/test_app.py::test_uvicorn_gets_the_server_options",
    "--ssl-ca-certs": (
        "tests/api/test_flag_effects.py::test_uvicorn_gets_the_client_certificate_options_and_the_access_log_switch"
    ),
    "--ssl-cert-reqs": (
        "tests/api/test_flag_effects.py::test_uvicorn_gets_the_client_certificate_options_and_the_access_log_switch"
    ),
    "--disable-fastapi-docs": "tests/api/test_app.py::test_docs_can_be_disabled",
    "--enable-request-id-headers": "tests/api/test_middleware.py::test_request_id_headers",
    "--return-tokens-as-token-ids": "tests/api/test_serving_completions.py::test_return_tokens_as_token_ids",
    "--max-log-len": (
        "tests/api/test_serving_completions.py::"
        "test_requests_are_logged_only_with_enable_log_requests_and_max_log_len_honoured"
    ),
    "--enable-log-requests": "tests/e2e/test_flags_smollm2.py::test_prompts_are_logged_only_with_enable_log_requests",
    "--disable-log-stats": "tests/api/test_server.py::test_run_server_serves_until_told_to_exit",
    "--chat-template": "tests/api/test_serving_chat.py::test_chat_template_override_changes_the_prompt",
    "--chat-template-content-format": (
        "tests/api/test_flag_effects.py::test_chat_template_content_format_decides_what_the_template_sees"
    ),
    "--trust-request-chat-template": "tests/e2e/test_tool_loop_smollm2.py::test_a_request_template_needs_the_trust_flag",
    "--response-role": "tests/api/test_serving_chat.py::test_response_role_option",
    "--enable-auto-tool-choice": "tests/api/test_serving_chat.py::test_auto_tool_choice_without_a_parser_is_a_400",
    "--tool-call-parser": "tests/api/test_serving_chat.py::test_tool_call_parser_from_the_registry",
    "--tool-parser-plugin": "tests/api/test_cli.py::test_serve_loads_the_named_plugins_and_hands_over_serve_args",
    "--plugin": "tests/api/test_cli.py::test_serve_loads_the_named_plugins_and_hands_over_serve_args",
    "--strict-plugins": (
        "tests/api/test_cli.py::test_the_real_command_refuses_a_broken_named_plugin_and_with_strict_a_broken_installed_one"
    ),
    "--enable-prompt-tokens-details": "tests/api/test_serving_completions.py::test_prompt_tokens_details",
    "--enable-server-load-tracking": "tests/e2e/test_flags_smollm2.py::test_load_counts_a_request_while_it_streams",
    "--max-request-body-bytes": "tests/api/test_middleware.py::test_body_too_large_by_content_length",
    "--responses-store-max-bytes": "tests/api/test_serving_responses.py::test_responses_store_max_bytes_bounds_what_the_server_keeps",
    # -- ModelConfig
    "--model": "tests/e2e/test_server_smollm2.py::test_models_lists_served_name",
    "--task": "tests/test_llm_pooling.py::test_a_pooling_model_does_not_generate",
    "--runner": "tests/test_llm_pooling.py::test_a_pooling_model_does_not_generate",
    "--convert": "tests/test_llm_pooling.py::test_convert_embed_pools_a_causal_lm",
    "--tokenizer": "tests/builtin_plugins/loaders/test_hf_formats.py::test_config_and_tokenizer_come_from_the_directory_with_overrides",
    "--tokenizer-mode": (
        "tests/api/test_flag_effects.py::test_tokenizer_mode_slow_asks_for_the_slow_tokenizer_and_mistral_is_refused"
    ),
    "--revision": "tests/builtin_plugins/model_sources/test_model_sources.py::test_hf_download_asks_only_for_model_files",
    "--dtype": (
        "tests/e2e/test_smollm2_greedy.py::"
        "test_float32_named_stays_dense_and_auto_narrows_small_batches_only_where_the_platform_chose"
    ),
    "--max-model-len": "tests/e2e/test_hardening.py::test_a_full_waiting_queue_answers_429_with_retry_after",
    "--served-model-name": "tests/plugins/test_scripted_model.py::test_resolved_model_name_is_not_the_served_name",
    "--seed": "tests/core/test_engine_llama.py::test_seed_flag_makes_unseeded_sampling_repeatable",
    "--hf-overrides": "tests/builtin_plugins/loaders/test_gguf_format.py::test_hf_overrides_apply_to_the_config",
    "--rope-scaling": "tests/builtin_plugins/loaders/test_gguf_config.py::test_rope_flags_and_hf_overrides_reach_the_config",
    "--rope-theta": "tests/builtin_plugins/loaders/test_gguf_config.py::test_rope_flags_and_hf_overrides_reach_the_config",
    "--max-logprobs": "tests/e2e/test_flags_smollm2.py::test_max_logprobs_minus_one_means_no_cap",
    "--logprobs-mode": "tests/core/test_sampler.py::test_logprobs_modes",
    "--skip-tokenizer-init": "tests/e2e/test_flags_smollm2.py::test_skip_tokenizer_init_serves_token_ids_and_refuses_text",
    "--generation-config": "tests/e2e/test_flags_smollm2.py::test_generation_config_folder_sets_defaults_and_caps_max_tokens",
    "--override-generation-config": (
        "tests/e2e/test_flags_smollm2.py::test_generation_config_folder_sets_defaults_and_caps_max_tokens"
    ),
    "--override-pooler-config": "tests/core/test_pooling.py::test_pooler_config_flag_overrides_the_files_field_by_field",
    "--pooler-config": "tests/core/test_pooling.py::test_pooler_config_flag_overrides_the_files_field_by_field",
    "--disable-sliding-window": "tests/api/test_flag_effects.py::test_disable_sliding_window_gives_every_layer_full_attention",
    "--model-impl": "tests/builtin_plugins/models/test_transformers_fallback.py::test_served_greedy_matches_transformers_with_chunked_prefill_and_a_prefix_hit",
    "--quantization": "tests/api/test_flag_effects.py::test_quantization_named_must_be_registered",
    # -- LoadConfig
    "--load-format": "tests/builtin_plugins/model_sources/test_model_sources.py::test_local_directory_and_gguf_file",
    "--download-dir": "tests/builtin_plugins/model_sources/test_model_sources.py::test_hf_resolves_from_the_cache_without_the_network",
    "--ignore-patterns": "tests/builtin_plugins/loaders/test_hf_formats.py::test_ignore_patterns_skip_matching_shards",
    "--use-tqdm-on-load": "tests/builtin_plugins/loaders/test_hf_formats.py::test_progress_bar_over_shards",
    # -- StructuredOutputsConfig
    "--guided-decoding-backend": "tests/e2e/test_structured_outputs.py::test_request_forms_become_one_structured_outputs_dict",
    "--guided-decoding-disable-fallback": "tests/core/test_structured_output.py::test_the_server_default_falls_back_unless_fallback_is_disabled",
    "--guided-decoding-disable-any-whitespace": "tests/api/test_flag_effects.py::test_guided_decoding_server_options_shape_every_json_constraint",
    "--guided-decoding-disable-additional-properties": "tests/api/test_flag_effects.py::test_guided_decoding_server_options_shape_every_json_constraint",
    "--reasoning-parser": "tests/api/test_serving_chat_tools.py::test_reasoning_and_tool_calls_in_one_response",
    "--structured-outputs-compile-timeout": "tests/e2e/test_hardening.py::test_a_schema_that_compiles_too_long_is_a_400_and_others_still_compile",
    "--structured-outputs-request-backends": "tests/e2e/test_hardening_structured.py::test_a_request_may_name_only_the_backends_the_operator_allows",
    # -- ParallelConfig
    "--distributed-executor-backend": "tests/api/test_flag_effects.py::test_distributed_executor_backend_names_the_executor",
    "--worker-use-ray": "tests/api/test_flag_effects.py::test_distributed_executor_backend_names_the_executor",
    "--tensor-parallel-size": "tests/e2e/test_parallel_smollm2.py::test_tp3_greedy_ids_equal_a_one_process_run",
    "--pipeline-parallel-size": "tests/e2e/test_pipeline_parallel_smollm2.py::test_concurrent_requests_match_one_worker",
    # -- CacheConfig
    "--block-size": "tests/core/test_engine_llama.py::test_greedy_matches_under_preemption",
    "--gpu-memory-utilization": "tests/api/test_flag_effects.py::test_gpu_memory_utilization_scales_the_kv_cache",
    "--kv-cache-memory-bytes": "tests/api/test_flag_effects.py::test_kv_cache_memory_bytes_sets_the_budget",
    "--num-gpu-blocks-override": "tests/core/test_engine_llama.py::test_greedy_matches_under_preemption",
    "--enable-prefix-caching": "tests/core/test_engine_llama.py::test_greedy_matches_with_prefix_caching",
    "--prefix-caching-hash-algo": "tests/api/test_flag_effects.py::test_prefix_caching_hash_algo_reaches_the_block_manager",
    "--kv-cache-dtype": "tests/api/test_flag_effects.py::test_kv_cache_dtype_names_the_cache_dtype",
    # -- SchedulerConfig
    "--max-num-batched-tokens": "tests/core/test_engine_llama.py::test_greedy_matches_with_chunked_prefill",
    "--max-num-seqs": "tests/api/test_request_limits.py::test_n_is_capped_by_the_engines_max_num_seqs",
    "--enable-chunked-prefill": (
        "tests/core/test_scheduler.py::test_without_chunked_prefill_prompts_wait_for_room_and_huge_ones_run_alone"
    ),
    "--max-num-partial-prefills": "tests/core/test_scheduler.py::test_partial_prefill_limit_and_long_prefill_threshold",
    "--long-prefill-token-threshold": "tests/core/test_scheduler.py::test_partial_prefill_limit_and_long_prefill_threshold",
    "--scheduling-policy": "tests/core/test_scheduler.py::test_waiting_order_by_policy",
    "--max-waiting-requests": "tests/e2e/test_hardening.py::test_a_full_waiting_queue_answers_429_with_retry_after",
    # -- DeviceConfig
    "--device": "tests/core/engine/test_llm_engine.py::test_the_config_stays_as_given_and_the_executor_gets_a_worker_spec",
}


# -- request fields ---------------------------------------------------------------------------

REQUEST_MODEL_MODULES = (
    "tokenloom.api.protocol",
    "tokenloom.api.server_protocol",
    "tokenloom.api.responses_protocol",
    "tokenloom.api.messages_protocol",
    "tokenloom.api.pooling_protocol",
)
# where request fields are declared: a read in their pydantic validators is not a use (their
# other methods, such as the structured-output constraint a request asks for, are)
REQUEST_MODEL_FILES = frozenset(
    {
        "api/protocol.py",
        "api/server_protocol.py",
        "api/responses_protocol.py",
        "api/messages_protocol.py",
        "api/pooling_protocol.py",
    }
)
# (model, field) -> what happens to a field the serving code does not read
UNREAD_REQUEST_FIELDS: dict[tuple[str, str], str] = {}
# field -> where it is read by a name held in a variable (``getattr(self, param)``), which the
# static check cannot follow; the name must still appear as a string outside the validators
READ_BY_NAME: dict[str, str] = {
    "guided_regex": "SamplingRequest.structured_output_constraint (protocol.py), by getattr",
    "guided_choice": "SamplingRequest.structured_output_constraint (protocol.py), by getattr",
    "guided_grammar": "SamplingRequest.structured_output_constraint (protocol.py), by getattr",
}


# -- the static check -------------------------------------------------------------------------


VALIDATOR_DECORATORS = frozenset({"field_validator", "model_validator", "validator", "root_validator"})


def _without_validators(tree: ast.AST) -> ast.AST:
    """``tree`` with pydantic validators removed: checking a field is not using it."""

    class Strip(ast.NodeTransformer):
        def visit_FunctionDef(self, node):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                if name in VALIDATOR_DECORATORS:
                    return None
            return self.generic_visit(node)

        visit_AsyncFunctionDef = visit_FunctionDef

    return Strip().visit(tree)


@functools.cache
def attribute_reads(excluded: frozenset[str], validators_only: frozenset[str] = frozenset()) -> dict[str, set[str]]:
    """attribute name -> the source of each object it is read from (``config.model`` for
    ``config.model.max_logprobs``), over the package minus ``excluded``; ``getattr(x, "name")``
    counts as a read of ``name`` from ``x``. In ``validators_only`` files, reads inside
    pydantic validators do not count."""
    reads: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in excluded:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if relative in validators_only:
            tree = _without_validators(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                reads.setdefault(node.attr, set()).add(ast.unparse(node.value))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                reads.setdefault(node.args[1].value, set()).add(ast.unparse(node.args[0]))
    return reads


def config_field(flag: Flag) -> tuple[str, str]:
    """(the config group the flag's field lives in, the field's name there)."""
    if flag.to == SERVER:
        return "server", flag.dest
    assert flag.to == ENGINE, flag
    if flag.dest in engine_config.STRUCTURED_OUTPUT_ARGS:
        return "structured_output", engine_config.STRUCTURED_OUTPUT_ARGS[flag.dest]
    return engine_config.ENGINE_ARG_GROUPS[flag.dest], flag.dest


def is_read(group: str, field: str, reads: dict[str, set[str]]) -> bool:
    """``field`` is read from a config object: one whose source names a config (``config``,
    ``model_config``, ``self.config.cache``, ``engine_args``, ``server``) or the field's group.
    An unrelated attribute of the same name (``request.seed``) does not count."""
    markers = ("config", "engine_args", "server", group)
    return any(any(marker in source.lower() for marker in markers) for source in reads.get(field, ()))


def unread_flags(catalogue: tuple[Flag, ...], reads: dict[str, set[str]]) -> list[str]:
    return [
        f"{flag.name} sets {'.'.join(config_field(flag))}, which nothing outside the config modules reads"
        for flag in catalogue
        if flag.status == IMPLEMENTED and flag.to != CLI and not is_read(*config_field(flag), reads)
    ]


def implemented_flags() -> list[Flag]:
    return [flag for flag in FLAGS if flag.status == IMPLEMENTED]


def test_every_implemented_flag_is_read_outside_the_config_modules():
    assert unread_flags(FLAGS, attribute_reads(CONFIG_MODULES)) == []


def test_the_static_check_catches_an_unread_field():
    """A fabricated flag whose field nothing reads is reported; one whose field is read is not."""
    reads = attribute_reads(CONFIG_MODULES)
    fabricated = flags.server("--frobnicate-widget-limit")  # no such ServerConfig field, nor any read
    read = FLAGS[[flag.name for flag in FLAGS].index("--max-log-len")]
    assert unread_flags((fabricated, read), reads) == [
        "--frobnicate-widget-limit sets server.frobnicate_widget_limit, which nothing outside the config modules reads"
    ]
    # a read of the same name from something that is not a config does not count
    assert not is_read("model", "seed", {"seed": {"request", "self.request"}})
    assert is_read("model", "seed", {"seed": {"request", "self.config.model"}})
    # a read inside the config modules is no use (validation is not behaviour): a tokenizer
    # revision is only refused there, so counting those modules would find it, and the rule does not
    assert is_read("model", "tokenizer_revision", attribute_reads(frozenset()))
    assert not is_read("model", "tokenizer_revision", reads)


def test_every_implemented_flag_has_a_behaviour_test_and_only_those():
    names = {flag.name for flag in implemented_flags()}
    assert sorted(names - BEHAVIOUR_TESTS.keys()) == [], (
        "add these flags to BEHAVIOUR_TESTS with the test that shows them"
    )
    assert sorted(BEHAVIOUR_TESTS.keys() - names) == [], "these are no longer implemented flags: remove them"


@functools.cache
def names_of_tests_in(relative_path: str) -> frozenset[str]:
    """``name`` and ``Class::name`` of every test function in a test module (parsed, not imported)."""
    path = ROOT / relative_path
    if not path.is_file():
        return frozenset()
    found: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            found.add(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            found |= {
                f"{node.name}::{item.name}"
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test")
            }
    return frozenset(found)


@pytest.mark.parametrize("flag_name", sorted(BEHAVIOUR_TESTS))
def test_the_named_behaviour_test_exists(flag_name):
    relative_path, _, test_name = BEHAVIOUR_TESTS[flag_name].partition("::")
    assert (ROOT / relative_path).is_file(), f"{flag_name}: no test module {relative_path}"
    assert test_name in names_of_tests_in(relative_path), f"{flag_name}: {relative_path} has no test {test_name}"


# -- request fields ---------------------------------------------------------------------------


def request_models() -> list[type]:
    import importlib

    from pydantic import BaseModel

    from tokenloom.api.protocol import RequestModel

    models = []
    for module_name in REQUEST_MODEL_MODULES:
        module = importlib.import_module(module_name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseModel)
                and value.__module__ == module_name
                and (issubclass(value, RequestModel) or value.__name__.endswith("Request"))
            ):
                models.append(value)
    return models


@functools.cache
def string_constants(validators_only: frozenset[str]) -> frozenset[str]:
    """Every string constant in the package's code, minus pydantic validators in ``validators_only``."""
    found: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if path.relative_to(PACKAGE).as_posix() in validators_only:
            tree = _without_validators(tree)
        found |= {
            node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
        }
    return frozenset(found)


def unread_request_fields(models: list[type], reads: dict[str, set[str]]) -> list[tuple[str, str]]:
    unread = []
    for model in models:
        for field_name in model.model_fields:
            if field_name in reads or (model.__name__, field_name) in UNREAD_REQUEST_FIELDS:
                continue
            if field_name in READ_BY_NAME and field_name in string_constants(REQUEST_MODEL_FILES):
                continue
            unread.append((model.__name__, field_name))
    return unread


def test_every_request_field_is_read_by_the_serving_code_or_declared():
    models = request_models()
    assert len(models) > 10
    assert unread_request_fields(models, attribute_reads(frozenset(), REQUEST_MODEL_FILES)) == []
    for (model_name, field_name), fate in UNREAD_REQUEST_FIELDS.items():
        model = next((model for model in models if model.__name__ == model_name), None)
        assert model is not None and field_name in model.model_fields, f"{model_name}.{field_name} does not exist"
        assert fate, f"{model_name}.{field_name}: say what happens to it"


def test_the_request_field_check_catches_a_field_nothing_reads():
    from pydantic import create_model

    from tokenloom.api.protocol import RequestModel

    fabricated = create_model("FrobnicateRequest", __base__=RequestModel, widget_limit=(int, 0), prompt=(str, ""))
    assert unread_request_fields([fabricated], attribute_reads(frozenset(), REQUEST_MODEL_FILES)) == [
        ("FrobnicateRequest", "widget_limit")
    ]


def test_config_dataclasses_hold_every_implemented_field():
    """The static check above would pass vacuously for a field that does not exist."""
    from tokenloom.api.server_config import ServerConfig

    server_fields = {field.name for field in dataclasses.fields(ServerConfig)}
    for flag in implemented_flags():
        if flag.to == SERVER:
            assert flag.dest in server_fields, flag.name
        elif flag.to == ENGINE:
            assert flag.dest in engine_config.ENGINE_ARG_GROUPS or flag.dest in engine_config.STRUCTURED_OUTPUT_ARGS
