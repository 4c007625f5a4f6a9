"""What a fleet device runs: one client, its training loops, the weights it exchanges and the frames it speaks."""
