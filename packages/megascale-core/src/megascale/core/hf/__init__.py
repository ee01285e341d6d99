"""Hugging Face checkpoints in and out of megascale's GPT, without transformers (safetensors and json only).

from megascale.core.hf import gpt_from_hf, save_hf
model = gpt_from_hf("path/to/Llama-3.2-1B")             # config.json + safetensors → GPT
save_hf(model, None, "out/", model_type="llama")        # GPT → a directory transformers loads

Model types: llama (Llama 2/3, 3.1/3.2 rope scaling), qwen2 (q/k/v biases), qwen3 (q/k norms, head_dim),
mistral (sliding window). Needs the ``hf`` extra: ``pip install 'megascale-core[hf]'``.
"""

from megascale.core.hf.config import MODEL_TYPES, gpt_config_from_hf, hf_config_from_gpt
from megascale.core.hf.convert import gpt_from_hf, load_hf_state_dict, save_hf
from megascale.core.hf.io import HFCheckpoint, write_safetensors
from megascale.core.hf.weights import TensorMapping, from_hf_tensors, tensor_map, to_hf_tensors

__all__ = [
    "MODEL_TYPES",
    "HFCheckpoint",
    "TensorMapping",
    "from_hf_tensors",
    "gpt_config_from_hf",
    "gpt_from_hf",
    "hf_config_from_gpt",
    "load_hf_state_dict",
    "save_hf",
    "tensor_map",
    "to_hf_tensors",
    "write_safetensors",
]
