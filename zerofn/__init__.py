"""zerofn: ZeRO as stateless, composable transforms over a plain nn.Module and optimizer."""
