(__DRAW_INTO__)('#step-chart .js-plotly-plot', () => {
  const box = document.querySelector('#step-index input[type=number]');
  return box ? Number(box.value) : undefined;
})
