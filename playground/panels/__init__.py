"""Panels that several views embed: the presenter view (Lessons, Step through) and the what-if row."""
