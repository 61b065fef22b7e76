"""Pictures that need no rich: HTML and SVG views for notebooks and pages, the colour scale, pooling to fit."""
