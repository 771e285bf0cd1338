"""What keeps a run alive and tells why it stopped, beside the training math: the iteration-boundary guards
(guards.py), the hang watchdog and its dumps (watchdog.py, diagnostics.py), the straggler report, preemption
signals and the run lock, CPU thread counts, the data workers' shutdown, injected faults for tests, and the one
rank-aware logger (log.py). training/ imports these; they never import training/."""
