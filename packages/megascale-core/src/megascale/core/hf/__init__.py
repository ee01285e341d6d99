"""Hugging Face checkpoints in and out of megascale's GPT, without transformers (safetensors and json only).

from megascale.core.hf import gpt_from_hf, save_hf
model = gpt_from_hf("path/to/Llama-3.2-1B")             # config.json + safetensors → GPT
save_hf(model, None, "out/", token_ids={"eos_token_id": 2})   # GPT → a directory transformers loads
load_hf_weights_(split_model, "path/to/Llama-3.2-1B")   # a tp/pp-split GPT: each rank reads its slices
meta_model.weights_source = HFWeights("path/to/Llama-3.2-1B")   # loaded so when parallelize materialises it

Model types: llama (Llama 2/3, 3.1/3.2 rope scaling), qwen2 (q/k/v biases), qwen3 (q/k norms, head_dim),
mistral (sliding window), and the mixtures of experts mixtral and qwen3_moe (``GPTConfig.moe``). Needs the ``hf`` extra: ``pip install 'megascale-core[hf]'``.
"""

from megascale.core.hf.config import (
    MODEL_TYPES,
    OVERRIDABLE,
    config_conflicts,
    gpt_config_from_hf,
    hf_config_from_gpt,
)
from megascale.core.hf.convert import gpt_from_hf, load_hf_state_dict, save_hf
from megascale.core.hf.io import HFCheckpoint, write_safetensors
from megascale.core.hf.load import HFWeights, LoadReport, load_hf_weights_, local_box
from megascale.core.hf.metadata import TOKEN_FIELDS, generation_config, hf_metadata, infer_model_type
from megascale.core.hf.weights import (
    TensorMapping,
    check_hf_tensors,
    from_hf_tensors,
    tensor_map,
    to_hf_tensors,
)

__all__ = [
    "MODEL_TYPES",
    "OVERRIDABLE",
    "TOKEN_FIELDS",
    "HFCheckpoint",
    "HFWeights",
    "LoadReport",
    "TensorMapping",
    "check_hf_tensors",
    "config_conflicts",
    "from_hf_tensors",
    "generation_config",
    "gpt_config_from_hf",
    "gpt_from_hf",
    "hf_config_from_gpt",
    "hf_metadata",
    "infer_model_type",
    "load_hf_state_dict",
    "load_hf_weights_",
    "local_box",
    "save_hf",
    "tensor_map",
    "to_hf_tensors",
    "write_safetensors",
]
