"""What the planner predicts from the measured costs: memory per rank and the step's time."""
