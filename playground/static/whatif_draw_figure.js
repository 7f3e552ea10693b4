(figure) => { if (figure) (__DRAW_STEP__)(JSON.parse(figure)); }
