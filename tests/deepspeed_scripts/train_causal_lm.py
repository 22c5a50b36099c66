"""A DeepSpeed training script for a Hugging Face causal language model built in the dtype
its config names (bf16, as ``from_pretrained`` builds a bf16 checkpoint); optimizer,
scheduler and loader from the DeepSpeed config.

    torchrun --nproc-per-node 2 train_causal_lm.py --deepspeed_config zero2_bf16.json

Changing ``import deepspeed`` to ``import zerofn.deepspeed as deepspeed`` runs it on zerofn.
"""
import argparse

import deepspeed
from tiny import script_arguments, write_record
from tiny_llama import make_llama, make_token_dataset


def add_argument():
    parser = argparse.ArgumentParser(description="tiny causal language model")
    parser = script_arguments(parser)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main(args):
    deepspeed.init_distributed()
    model = make_llama()
    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(),
        training_data=make_token_dataset())

    losses = []
    while model_engine.global_steps < args.steps:
        for (input_ids,) in trainloader:
            input_ids = input_ids.to(model_engine.device)
            loss = model_engine(input_ids=input_ids, labels=input_ids).loss
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            if model_engine.global_steps >= args.steps:
                break
    write_record(args.losses, model_engine, losses)


if __name__ == "__main__":
    main(add_argument())
