"""A DeepSpeed training script with the optimizer built by the client, as DeepSpeed's
getting-started guide shows, and its own DataLoader over a DistributedSampler.

    torchrun --nproc-per-node 2 train_client_optimizer.py --deepspeed_config zero2_nvme_accum.json

Changing ``import deepspeed`` to ``import zerofn.deepspeed as deepspeed`` runs it on zerofn.
"""
import argparse

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import deepspeed
from tiny import make_dataset, make_model, script_arguments, write_record


def add_argument():
    parser = argparse.ArgumentParser(description="tiny regression, client optimizer")
    parser = script_arguments(parser)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main(args):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95),
                                  weight_decay=0.05)
    model_engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model,
                                                         optimizer=optimizer)

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=model_engine.world_size,
                                 rank=model_engine.global_rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=model_engine.train_micro_batch_size_per_gpu(),
                        sampler=sampler)

    losses = []
    while model_engine.global_steps < args.steps:
        for x, y in loader:
            x, y = x.to(model_engine.device), y.to(model_engine.device)
            loss = torch.nn.functional.mse_loss(model_engine(x), y)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            if model_engine.global_steps >= args.steps:
                break
    write_record(args.losses, model_engine, losses)


if __name__ == "__main__":
    main(add_argument())
