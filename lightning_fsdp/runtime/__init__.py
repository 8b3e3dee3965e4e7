"""Starting and ending processes: local ranks under a deadline (tests, benchmarks) and the exit of a process that
used gloo. Imports torch only."""
