"""What several formats share: the offloaded meta model, reference outputs and output
comparison, and child processes with memory checks. No format package imports another; what
two of them need lives here."""
