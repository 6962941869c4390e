"""How a validated config becomes running ranks: in this process (launcher=local) or under
torchrun (launcher=torchrun), which runs gemctl.launch.worker on every rank."""
