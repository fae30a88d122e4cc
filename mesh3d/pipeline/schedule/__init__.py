"""The schedule compiler, free of torch: the schedule IR, its generators and catalog, lowering
(communication added, deadlock-freedom checked), the timed replay, the simulator and drawing."""
