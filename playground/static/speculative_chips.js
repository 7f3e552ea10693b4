const pick = (chip) => trigger('click', {round: Number(chip.dataset.round), pos: Number(chip.dataset.pos)});
element.addEventListener('click', (event) => {
  const chip = event.target.closest('[data-chip]');
  if (chip) pick(chip);
});
element.addEventListener('keydown', (event) => {
  const chip = event.target.closest('[data-chip]');
  if (chip && (event.key === 'Enter' || event.key === ' ')) { event.preventDefault(); pick(chip); }
});
