"""The devices' data: any training set cut into partitions (`partitions`), and the bundled digits."""
