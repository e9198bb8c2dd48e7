"""A picture of a run from its files alone: a timeline page, Perfetto's trace format."""
