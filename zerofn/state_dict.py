"""Face of zerofn/state/state_dict.py (state dicts in torch.distributed.checkpoint's
format); re-exports it."""
from .state.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                               set_state_dict)

__all__ = ["get_model_state_dict", "get_state_dict", "set_model_state_dict", "set_state_dict"]
