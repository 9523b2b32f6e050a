"""What a person or a tool looks at: dumps of the rewritten graphs, the float64 oracle."""
