"""Starting, watching and stopping the ranks of a node: the launcher (`launch`, `agent`: torch's elastic
agent), the checks it runs before any rank starts (`preflight`), its hang watchdog (`hang_watchdog`) and
its rows of the goodput ledger (`launch_ledger`). What a rank owes the launcher (the stop-signal recorder,
the agreement on stopping, the failure report) is in `titanlite.run`, which never imports this package.
"""
