(id) => {
  if (!id) return;
  let tries = 0;
  const press = () => {
    const button = document.getElementById(id);
    if (button && button.offsetParent !== null) button.click();
    else if (++tries < 50) setTimeout(press, 100);
  };
  press();
}
