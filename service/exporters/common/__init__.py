"""What several formats share: the offloaded meta model, the model families, the files that
travel with the weights, and child processes with memory checks. No format package imports
another; what two of them need lives here (how their output is judged: service.verification)."""
