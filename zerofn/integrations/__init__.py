"""Integrations with other libraries, each imported only by its own module (so the core
package never imports them): ``zerofn.integrations.transformers`` for Hugging Face's
``Trainer`` (install with ``pip install -e '.[hf]'`` in the checkout) and
``zerofn.integrations.lightning`` for PyTorch Lightning's ``Trainer`` and ``Fabric``
(``pip install -e '.[lightning]'``)."""

# Submodules only, none imported here: ``from zerofn.integrations import *`` imports them.
__all__ = ["transformers", "lightning"]
