"""What mesh3d needs of the user's whole model: its loss contract, initialization of the parts a
rank owns, per-block compile, and the state map (which rank holds which parameter name)."""
