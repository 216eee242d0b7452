"""Replica-group fault tolerance (torchft): a job made of replica groups, each an ordinary run over its own
ranks, that average their gradients through torchft's manager once per step; the live groups go on when one
fails, and a group that comes back receives the state from a live one and rejoins. docs/fault_tolerance.md."""
