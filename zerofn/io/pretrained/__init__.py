"""Hugging Face weight files in and out of a zerofn model, without a full copy on any rank.

``load_pretrained`` (load.py) reads a ``.safetensors`` file or a Hugging Face model
directory (one ``model.safetensors``, or shards listed in ``model.safetensors.index.json``)
into a transformed model; ``save_pretrained`` (save.py) writes that layout, which
``transformers.AutoModelForCausalLM.from_pretrained`` loads; safetensors_writer.py writes
the file format.
"""
from .load import load_pretrained
from .safetensors_writer import INDEX_NAME, SINGLE_NAME
from .save import save_pretrained

__all__ = ["INDEX_NAME", "SINGLE_NAME", "load_pretrained", "save_pretrained"]
