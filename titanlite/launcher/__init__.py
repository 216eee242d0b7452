"""Starting and stopping ranks: the launcher (`launch`, `agent`: torch's elastic agent), the checks it runs
before any rank starts (`preflight`, `socket_interfaces`), and what every rank owes it (`signals`: the
stop-signal recorder each process installs first; `resilience`: preemption and non-finite steps, agreed
once per step; `rank_exit`: dying with the launcher, the failure report, the exit codes)."""
