"""FlatCake-Ray."""
