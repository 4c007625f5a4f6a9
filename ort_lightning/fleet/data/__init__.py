"""The data a fleet trains on: the bundled digits, and partitions of any data set across devices."""
