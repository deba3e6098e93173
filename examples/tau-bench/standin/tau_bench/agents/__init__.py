"""The stand-in's agents package: only what the seed's agent imports from it."""
