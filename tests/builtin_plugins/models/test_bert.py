"""The BERT encoder plugin against transformers' ``BertModel`` with the same (perturbed,
random) weights: hidden states of a flat batch of prompts of different lengths, attending
bidirectionally within each prompt only; checkpoint names with a ``bert.`` prefix and
old ``gamma``/``beta`` LayerNorm names; a light registration module."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers.attention import build_attention_metadata
from helpers.model_parity import perturb_parameters

from tokenloom.builtin_plugins.models.modeling_bert import BertModel
from tokenloom.core.model_interface import ModelContext
from tokenloom.core.pooling import PoolerConfig
from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.kernels.paged_attention import ReferencePagedAttention, TorchPagedAttention

PROMPTS = [[101, 7, 8, 9, 102], [101, 5, 102], [101] + list(range(20, 45)) + [102]]


def tiny_config(**overrides):
    from transformers import BertConfig

    values = dict(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        type_vocab_size=2,
        hidden_act="gelu",
        layer_norm_eps=1e-12,
    )
    return BertConfig(**{**values, **overrides})


@pytest.fixture(scope="module", params=["gelu", "gelu_new"])
def hf_bert(request):
    from transformers import BertModel as HFBertModel

    torch.manual_seed(0)
    config = tiny_config(hidden_act=request.param)
    return perturb_parameters(HFBertModel(config, add_pooling_layer=True).eval(), scale=0.1)


def build(hf_model, pooler_config=None, weights=None):
    model = BertModel(
        ModelContext(
            hf_config=hf_model.config,
            dtype=torch.float32,
            device=torch.device("cpu"),
            runner="pooling",
            pooler_config=pooler_config,
        )
    )
    loaded = model.load_weights(weights if weights is not None else hf_model.state_dict().items())
    return model.eval(), loaded


def run_flat(model, prompts, backend):
    """All prompts in one flat batch, as the runner sends them (positions restart per prompt,
    no KV cache, bidirectional left for the model to set)."""
    lens = [len(prompt) for prompt in prompts]
    metadata = build_attention_metadata(lens, lens, [[0] * 8 for _ in prompts], 16, [], backend)
    input_ids = torch.tensor([token for prompt in prompts for token in prompt])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        return model(input_ids, positions, metadata)


@pytest.mark.parametrize("backend", [TorchPagedAttention(), ReferencePagedAttention()], ids=["torch", "reference"])
def test_hidden_states_match_transformers(hf_bert, backend):
    model, loaded = build(hf_bert)
    assert {name for name, _ in model.named_parameters()} <= loaded
    hidden_states = run_flat(model, PROMPTS, backend)
    start = 0
    for prompt in PROMPTS:
        with torch.no_grad():
            expected = hf_bert(torch.tensor([prompt])).last_hidden_state[0]
        torch.testing.assert_close(hidden_states[start : start + len(prompt)], expected, atol=2e-5, rtol=1e-4)
        start += len(prompt)


def test_pooler_follows_the_resolved_config(hf_bert):
    model, _ = build(hf_bert, PoolerConfig(pooling_type="MEAN", normalize=True))
    assert (model.pooler.pooling_type, model.pooler.normalize) == ("MEAN", True)
    hidden_states = run_flat(model, PROMPTS, TorchPagedAttention())
    pooled = model.pooler(hidden_states, [len(prompt) for prompt in PROMPTS])
    with torch.no_grad():
        expected = hf_bert(torch.tensor([PROMPTS[2]])).last_hidden_state[0].mean(dim=0)
    torch.testing.assert_close(pooled[2], torch.nn.functional.normalize(expected, dim=0), atol=1e-5, rtol=1e-4)
    assert build(hf_bert)[0].pooler.pooling_type == "CLS"  # BERT's own default


def test_checkpoints_with_a_bert_prefix_and_gamma_beta_names_load(hf_bert):
    renamed = []
    for name, tensor in hf_bert.state_dict().items():
        name = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        renamed.append(("bert." + name, tensor))
    renamed.append(("cls.predictions.bias", torch.zeros(120)))  # a pre-training head: skipped
    model, _ = build(hf_bert, weights=renamed)
    reference, _ = build(hf_bert)
    backend = TorchPagedAttention()
    torch.testing.assert_close(run_flat(model, PROMPTS, backend), run_flat(reference, PROMPTS, backend))


def test_a_missing_weight_is_named():
    from transformers import BertModel as HFBertModel

    weights = [
        (name, tensor)
        for name, tensor in HFBertModel(tiny_config()).state_dict().items()
        if "layer.1.attention.self.key" not in name
    ]
    with pytest.raises(ModelLoadError, match=r"encoder\.layer\.1\.attention\.self\.qkv_proj"):
        build(HFBertModel(tiny_config()), weights=weights)


def test_bert_is_an_encoder_without_kv_cache_or_logits(hf_bert):
    model, _ = build(hf_bert)
    assert model.kv_cache_spec.num_layers == 0
    with pytest.raises(ConfigError, match="cannot generate"):
        model.compute_logits(torch.zeros(1, 32))
    with pytest.raises(ConfigError, match="position embeddings"):
        run_flat(model, [list(range(1, 70))], TorchPagedAttention())


def test_unsupported_configs_are_config_errors():
    with pytest.raises(ConfigError, match="absolute"):
        BertModel(
            ModelContext(
                hf_config=tiny_config(position_embedding_type="relative_key"),
                dtype=torch.float32,
                device=torch.device("cpu"),
            )
        )
    with pytest.raises(ConfigError, match="activation"):
        BertModel(
            ModelContext(hf_config=tiny_config(hidden_act="swish"), dtype=torch.float32, device=torch.device("cpu"))
        )


@pytest.mark.hook("register_models")
def test_the_models_plugin_registers_bert_as_a_pooling_model_without_importing_torch():
    code = (
        "import sys; import tokenloom.builtin_plugins.models as models; found = []; "
        "models.register_models(lambda name, target, **options: found.append((name, target, options))); "
        "print([entry for entry in found if entry[0] == 'BertModel']); print('torch' in sys.modules)"
    )
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert lines[0] == (
        "[('BertModel', 'tokenloom.builtin_plugins.models.modeling_bert:BertModel', {'runner': 'pooling'})]"
    )
    assert lines[1] == "False"
