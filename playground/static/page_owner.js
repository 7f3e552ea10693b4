(...args) => {
  if (window.dp && window.dp.owner) args[__AT__] = window.dp.owner;
  return args;
}
