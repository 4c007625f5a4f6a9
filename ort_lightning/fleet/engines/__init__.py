"""Where a fleet's devices run: in this process, on Ray, as Flower SuperNodes, or in browsers."""
