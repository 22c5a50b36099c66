"""A DeepSpeed training script written the way DeepSpeed's tutorials write one: the optimizer
and scheduler come from the config's "optimizer" and "scheduler" sections, the data loader
from ``training_data``.

    torchrun --nproc-per-node 2 train_config_optimizer.py --deepspeed_config zero3_offload.json

Changing ``import deepspeed`` to ``import zerofn.deepspeed as deepspeed`` runs it on zerofn.
"""
import argparse

import torch

import deepspeed
from tiny import make_dataset, make_model, script_arguments, write_record


def add_argument():
    parser = argparse.ArgumentParser(description="tiny regression")
    parser = script_arguments(parser)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main(args):
    deepspeed.init_distributed()
    net = make_model()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=make_dataset())

    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = torch.nn.MSELoss()
    losses = []
    while model_engine.global_steps < args.steps:
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(model_engine.device), labels.to(model_engine.device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs.float(), labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            if model_engine.global_steps >= args.steps:
                break
    write_record(args.losses, model_engine, losses)


if __name__ == "__main__":
    main(add_argument())
