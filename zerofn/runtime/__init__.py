"""What a plan becomes: unit layout, collectives, hooks and the sharded optimizer."""
