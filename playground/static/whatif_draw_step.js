(__DRAW_INTO__)('#' + __ID_STEP_CHART__ + ' .js-plotly-plot', () => {
  const box = document.querySelector('#' + __ID_STEP_INDEX__ + ' input[type=number]');
  return box ? Number(box.value) : undefined;
})
