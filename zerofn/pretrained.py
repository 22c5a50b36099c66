"""Face of zerofn/io/pretrained/, where Hugging Face weight files live now; re-exports it."""
from .io.pretrained import INDEX_NAME, SINGLE_NAME, load_pretrained, save_pretrained

__all__ = ["INDEX_NAME", "SINGLE_NAME", "load_pretrained", "save_pretrained"]
