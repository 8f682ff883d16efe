// The plotly.js the dashboard loads (dashboard/assets/plotly-scatter-heatmap-<version>.min.js): the
// core (the scatter trace, axes, legend, hover, shapes, annotations, colorbars) and the heatmap
// trace, the only two traces the dashboard draws. Built by build.sh beside this file.
'use strict';
var Plotly = require('plotly.js/lib/core');
Plotly.register([require('plotly.js/lib/heatmap')]);
module.exports = Plotly;
